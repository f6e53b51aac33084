"""The update statistics' rules, shared by TensorFlow's and JAX's step.

Each step keeps the statistics in one vector (float64 on TensorFlow, float32
on JAX, which has no float64 unless x64 is enabled) and updates it with
`after_update` once per update, applied or skipped; `logs` turns it into the
names of `statistics.LOG_NAMES`. Written with `keras.ops`, so one rule serves
both backends.
"""

import numpy as np
from keras import ops

from keras_safe_dist.update import statistics

# The vector's fields: the last update's gradient norm and samples, the
# epoch's applied, clipped and skipped updates, the fit's skipped updates,
# the epoch's first skipped update (its index + 1, so that 0 means none) and
# its samples, then the epoch's min, sum and max of the applied updates'
# gradient norms and samples.
FIELDS = (
    "grad_norm",
    "samples_per_update",
    "updates_in_epoch",
    "clipped_in_epoch",
    "skipped_updates",
    "skipped_in_epoch",
    "first_skip",
    "first_skip_samples",
    "grad_norm_min",
    "grad_norm_sum",
    "grad_norm_max",
    "samples_min",
    "samples_sum",
    "samples_max",
)
# 1.0 for a field an epoch's start keeps, 0.0 for one it resets.
KEPT_ACROSS_EPOCHS = (1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0) + (0.0,) * 6


def index(name):
    """The position of field `name` in the vector."""
    return FIELDS.index(name)


def after_update(stats, applied, norm, clipped, samples):
    """The statistics vector after one update.

    Written as a few operations on the whole vector, selected by constant
    masks: one expression per field made XLA (CPU) compute each in a kernel
    of its own, a dozen launches per step.

    Args:
        stats: the vector before the update.
        applied: whether the update was applied (a skipped one was not),
            a boolean or 0/1 scalar.
        norm: the reduced gradient's global norm, before clipping.
        clipped: whether clipping changed the gradient, a boolean scalar.
        samples: the update's samples.

    Returns:
        The new vector, of `stats`'s dtype.
    """
    dtype = stats.dtype
    applied = ops.cast(applied, dtype)
    norm = ops.cast(norm, dtype)
    samples = ops.cast(samples, dtype)
    clipped = ops.cast(clipped, dtype)
    skipped = 1.0 - applied
    updates = stats[index("updates_in_epoch")]
    skipped_in_epoch = stats[index("skipped_in_epoch")]
    first_skip = skipped * ops.cast(ops.equal(skipped_in_epoch, 0.0), dtype)
    # The latest norm or sample count where a field takes one; where, not a
    # product, so that a non-finite norm stays in its own fields.
    value = ops.where(_MASKS["of_norm"], norm, samples)
    first = ops.equal(updates, 0.0)  # the epoch's first applied update starts min and max
    spread = ops.where(
        _MASKS["min"],
        ops.where(first, value, ops.minimum(stats, value)),
        ops.where(_MASKS["max"], ops.where(first, value, ops.maximum(stats, value)), stats + value),
    )
    # A skipped update (its norm not finite) leaves the spread as it is.
    spread = ops.where(ops.equal(applied, 0.0), stats, spread)
    counts = (
        stats
        + ops.cast(_MASKS["updates_in_epoch"], dtype) * applied
        + ops.cast(_MASKS["clipped_in_epoch"], dtype) * (applied * clipped)
        + ops.cast(_MASKS["skipped"], dtype) * skipped
        + ops.cast(_MASKS["first_skip"], dtype) * (first_skip * (updates + skipped_in_epoch + 1.0))
        + ops.cast(_MASKS["first_skip_samples"], dtype) * (first_skip * samples)
    )
    return ops.where(_MASKS["latest"], value, ops.where(_MASKS["spread"], spread, counts))


def _mask(*names):
    return np.array([name in names for name in FIELDS])


_MASKS = {
    "of_norm": _mask("grad_norm", "grad_norm_min", "grad_norm_sum", "grad_norm_max"),
    "latest": _mask("grad_norm", "samples_per_update"),
    "spread": _mask(*(f"{n}_{p}" for n in ("grad_norm", "samples") for p in ("min", "sum", "max"))),
    "min": _mask("grad_norm_min", "samples_min"),
    "max": _mask("grad_norm_max", "samples_max"),
    "updates_in_epoch": _mask("updates_in_epoch"),
    "clipped_in_epoch": _mask("clipped_in_epoch"),
    "skipped": _mask("skipped_updates", "skipped_in_epoch"),
    "first_skip": _mask("first_skip"),
    "first_skip_samples": _mask("first_skip_samples"),
}


def logs(stats):
    """`{name: value}` for every name in `statistics.LOG_NAMES`, from the vector."""
    field = {name: stats[i] for i, name in enumerate(FIELDS)}
    updates = field["updates_in_epoch"]
    values = {
        "grad_norm": field["grad_norm"],
        "clip_rate": ops.divide_no_nan(field["clipped_in_epoch"], updates),
        "skipped_updates": field["skipped_updates"],
        "samples_per_update": field["samples_per_update"],
    }
    for name, key in (("grad_norm", "grad_norm"), ("samples_per_update", "samples")):
        values[f"{name}_min"] = field[f"{key}_min"]
        values[f"{name}_mean"] = ops.divide_no_nan(field[f"{key}_sum"], updates)
        values[f"{name}_max"] = field[f"{key}_max"]
    return {name: values[name] for name in statistics.LOG_NAMES}


def first_skip(values):
    """`(update index, samples)` of the epoch's first skipped update, or None.

    Args:
        values: the vector read on the host, as a list of floats.
    """
    field = dict(zip(FIELDS, values))
    if field["skipped_in_epoch"] == 0:
        return None
    return int(field["first_skip"]) - 1, int(field["first_skip_samples"])
