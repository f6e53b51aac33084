"""The update statistics' rules, shared by TensorFlow's and JAX's step.

Each step keeps the statistics in one vector (float64 on TensorFlow, float32
on JAX, which has no float64 unless x64 is enabled) and updates it with
`after_update` once per update, applied or skipped; `logs` turns it into the
names of `statistics.LOG_NAMES`. Written with `keras.ops`, so one rule serves
both backends.
"""

from keras import ops

from keras_safe_dist import statistics

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
    old = {name: stats[i] for i, name in enumerate(FIELDS)}
    applied = ops.cast(applied, dtype)
    norm = ops.cast(norm, dtype)
    samples = ops.cast(samples, dtype)
    skipped = 1.0 - applied
    first_skip = skipped * ops.cast(ops.equal(old["skipped_in_epoch"], 0.0), dtype)
    new = dict(old)
    first_update = ops.equal(old["updates_in_epoch"], 0.0)
    kept = ops.equal(applied, 0.0)
    # A skipped update (its norm not finite) leaves the spread as it is.
    for name, value in (("grad_norm", norm), ("samples", samples)):
        low, total, high = (old[f"{name}_{part}"] for part in ("min", "sum", "max"))
        new[f"{name}_min"] = ops.where(
            kept, low, ops.where(first_update, value, ops.minimum(low, value))
        )
        new[f"{name}_sum"] = ops.where(kept, total, total + value)
        new[f"{name}_max"] = ops.where(
            kept, high, ops.where(first_update, value, ops.maximum(high, value))
        )
    new.update(
        grad_norm=norm,
        samples_per_update=samples,
        updates_in_epoch=old["updates_in_epoch"] + applied,
        clipped_in_epoch=old["clipped_in_epoch"] + applied * ops.cast(clipped, dtype),
        skipped_updates=old["skipped_updates"] + skipped,
        skipped_in_epoch=old["skipped_in_epoch"] + skipped,
        first_skip=old["first_skip"]
        + first_skip * (old["updates_in_epoch"] + old["skipped_in_epoch"] + 1.0),
        first_skip_samples=old["first_skip_samples"] + first_skip * samples,
    )
    return ops.stack([new[name] for name in FIELDS])


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
