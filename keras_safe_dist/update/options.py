"""`SafeDistributedModel`'s options: their defaults and checks.

- `DEFAULTS`: each option and its default;
- `validate(...)`: the options checked and normalized, as the constructor, an
  assignment after it and `from_config` take them;
- `refuse_misspelled(...)`: a keyword that looks meant for an option (a
  misspelling, or another library's name for it) refused, not ignored;
- `check_optimizer(optimizer)`: an optimizer's own clipping or accumulation
  refused, in the terms of the backend in use.
"""

import difflib
import inspect
import numbers

import keras

from keras_safe_dist.core import _validate
from keras_safe_dist.core import on_jax

# Each option and its default, in the constructor's order.
DEFAULTS = {
    "gradient_accumulation_steps": 1,
    "global_clipnorm": None,
    "clipnorm": None,
    "clipvalue": None,
    "skip_nonfinite": True,
    "log_update_stats": False,
    "accumulation_dtype": None,
}

# The clipping modes: at most one is set.
CLIPPING = ("global_clipnorm", "clipnorm", "clipvalue")


def validate(
    gradient_accumulation_steps,
    global_clipnorm,
    clipnorm,
    clipvalue,
    skip_nonfinite,
    log_update_stats,
    accumulation_dtype=None,
    assigned=None,
):
    """The options, checked and normalized.

    `assigned` names the option being assigned after construction, if any:
    a clipping conflict then says how to switch modes.
    """
    steps = _validate.integer_at_least(
        "gradient_accumulation_steps", gradient_accumulation_steps
    )
    clips = dict(zip(CLIPPING, (global_clipnorm, clipnorm, clipvalue)))
    for name, value in clips.items():
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not value > 0
            or value == float("inf")
        ):
            raise ValueError(
                f"`{name}` must be a finite number > 0 or None. "
                f"Received: {name}={value!r}"
            )
    given = {name: value for name, value in clips.items() if value is not None}
    if len(given) > 1:
        received = ", ".join(f"{name}={value!r}" for name, value in clips.items())
        switch = ""
        if assigned in given:
            others = " and ".join(f"model.{n} = None" for n in given if n != assigned)
            switch = (
                f". To switch to `{assigned}`, first set the mode in use to None "
                f"({others}), then assign {assigned}"
            )
        raise ValueError(
            "Only one of `global_clipnorm`, `clipnorm` and `clipvalue` can be "
            f"set. Received: {received}{switch}"
        )
    for name, value in (
        ("skip_nonfinite", skip_nonfinite),
        ("log_update_stats", log_update_stats),
    ):
        if not isinstance(value, bool):
            raise ValueError(
                f"`{name}` must be True or False. Received: {name}={value!r}"
            )
    return {
        "gradient_accumulation_steps": int(steps),
        **{name: None if v is None else float(v) for name, v in clips.items()},
        "skip_nonfinite": skip_nonfinite,
        "log_update_stats": log_update_stats,
        "accumulation_dtype": _validate_accumulation_dtype(accumulation_dtype),
    }


_ACCUMULATION_DTYPES = ("bfloat16", "float32", "float64")


def _validate_accumulation_dtype(value):
    """None, or the standardized name of a floating dtype the sums can be kept in."""
    if value is None:
        return None
    try:
        dtype = keras.backend.standardize_dtype(value)
    except (TypeError, ValueError, AttributeError):
        dtype = None
    if dtype == "float16":
        raise ValueError(
            "`accumulation_dtype` cannot be 'float16': the sums hold a group's summed "
            "gradient (before it is divided by the group's loss denominator), which "
            "can pass float16's largest value, 65504. Received: "
            f"accumulation_dtype={value!r}. Use 'bfloat16' (float32's range, half "
            "its bytes) or None."
        )
    if dtype not in _ACCUMULATION_DTYPES:
        raise ValueError(
            "`accumulation_dtype` must be None or one of "
            f"{', '.join(repr(d) for d in _ACCUMULATION_DTYPES)}. "
            f"Received: accumulation_dtype={value!r}"
        )
    if dtype == "float64" and on_jax():
        import jax  # the backend in use: imported by Keras already

        if not jax.config.jax_enable_x64:
            raise ValueError(
                "`accumulation_dtype='float64'` needs 64-bit types, which JAX has "
                "off: its sums would be float32. Call "
                "`jax.config.update('jax_enable_x64', True)` before building the "
                "model, or pass accumulation_dtype=None or 'float32'."
            )
    return dtype


# Keras's own constructor arguments: never taken for a misspelled option.
_KERAS_ARGUMENTS = frozenset(inspect.signature(keras.layers.Layer.__init__).parameters) | {
    "inputs",
    "outputs",
}


# Words of other libraries' names for the options (`accum_steps`, `max_grad_norm`,
# `skip_nan`), each with the option it means, in the order they are tried.
_OPTION_WORDS = (
    ("accum", "gradient_accumulation_steps"),
    ("norm", "global_clipnorm"),
    ("clip", "global_clipnorm"),
    ("skip", "skip_nonfinite"),
    ("finite", "skip_nonfinite"),
    ("nan", "skip_nonfinite"),
    ("stat", "log_update_stats"),
)


def _meant_option(name, other_libraries=True):
    """The option `name` looks meant for, or None; `other_libraries`: also by `_OPTION_WORDS`."""
    held = [option for option in DEFAULTS if name in option or option in name]
    close = held or difflib.get_close_matches(name, DEFAULTS, n=1, cutoff=0.7)
    if close:
        return close[0]
    if not other_libraries:
        return None
    lowered = name.lower()
    return next((option for word, option in _OPTION_WORDS if word in lowered), None)


def closest(names):
    """`" (did you mean 'x'?)"` for the first of `names` that looks meant for an option, else `""`.

    An option that holds the name, or that the name holds, comes first
    (`accumulation_steps` is `gradient_accumulation_steps` shortened, though
    its letters are as close to `accumulation_dtype`); then the closest
    spelling; then a word of another library's name (`accum_steps`,
    `max_grad_norm`).
    """
    for name in names:
        meant = _meant_option(name)
        if meant is not None:
            return f" (did you mean {meant!r}?)"
    return ""


def refuse_misspelled(cls_name, kwargs, other_libraries=True):
    """Raises a `TypeError` for a keyword that looks meant for an option.

    Stock `keras.Model` accepts and ignores unknown keywords for a functional
    model, so `gradient_accumulation=4` or (`other_libraries`) `accum_steps=4`
    would train with no accumulation and no word. Other unknown keywords go to
    Keras as they would for stock.
    """
    misspelled = [
        name for name in kwargs
        if name not in _KERAS_ARGUMENTS and _meant_option(name, other_libraries) is not None
    ]
    if misspelled:
        raise TypeError(
            f"{cls_name} got unexpected keyword arguments {misspelled}{closest(misspelled)}: "
            f"they are not options, and would be ignored. The options are "
            f"{sorted(DEFAULTS)}. Received: "
            + ", ".join(f"{name}={kwargs[name]!r}" for name in misspelled)
        )


# Why an optimizer option is refused, in the terms of each backend.
_TF_CLIPS = "clips each replica's gradient before the cross-replica all-reduce"
_JAX_CLIPS = (
    "clips inside the optimizer, after SafeDistributedModel has accumulated the "
    "update, where its update statistics (`grad_norm`, `clip_rate`) do not see it "
    "(on JAX the optimizer clips the gradient reduced over all devices, as on one "
    "device; on TensorFlow the same option clips each replica's gradient before "
    "the all-reduce)"
)
_OPTIMIZER_OPTIONS = {
    "tensorflow": {
        "clipnorm": _TF_CLIPS,
        "global_clipnorm": _TF_CLIPS,
        "clipvalue": _TF_CLIPS,
        "gradient_accumulation_steps": (
            "crashes under MirroredStrategy (a merge_call inside tf.cond) and "
            "weights uneven micro-batches equally"
        ),
    },
    "jax": {
        "clipnorm": _JAX_CLIPS,
        "global_clipnorm": _JAX_CLIPS,
        "clipvalue": _JAX_CLIPS,
        "gradient_accumulation_steps": (
            "would average SafeDistributedModel's updates again inside the "
            "optimizer, each with the same weight, so an update of fewer samples "
            "(the end of an epoch) counts as much as a full one, and the update "
            "statistics would count updates the optimizer does not apply"
        ),
    },
}


def check_optimizer(optimizer):
    """Raises a `ValueError` when `optimizer` (or the one it wraps) clips or accumulates itself."""
    inner = getattr(optimizer, "inner_optimizer", None)
    for candidate in (optimizer, inner):
        if candidate is None:
            continue
        reasons = _OPTIMIZER_OPTIONS.get(keras.backend.backend(), _OPTIMIZER_OPTIONS["tensorflow"])
        for name, why in reasons.items():
            value = getattr(candidate, name, None)
            if value is not None:
                raise ValueError(
                    f"The optimizer passed to SafeDistributedModel.compile() "
                    f"sets `{name}={value!r}`, which {why}. Pass `{name}` to "
                    f"SafeDistributedModel(...) instead and leave it unset on "
                    f"the optimizer. Received optimizer: {candidate.name}"
                )
