"""The update statistics' names, shared by the `Dashboard` and `report` (no TensorFlow)."""

__all__ = [
    "LOG_NAMES",
    "PREFIX",
    "RUN",
    "SPREAD",
    "STATISTICS",
    "UPDATE_PREFIX",
    "description",
    "spread_names",
]

# log name: chart title
STATISTICS = {
    "grad_norm": "gradient norm (reduced, before clipping)",
    "clip_rate": "clip rate (share of updates clipped)",
    "skipped_updates": "skipped non-finite updates",
    "samples_per_update": "samples per update",
}
# The epoch's spread of these statistics over its applied updates, logged
# beside them as `<name>_min`, `<name>_mean` and `<name>_max`: the plain name
# holds the epoch's last update, which a partial last group makes atypical.
SPREAD = {
    "grad_norm": ("min", "mean", "max"),
    "samples_per_update": ("min", "mean", "max"),
}


def spread_names(name):
    """The log names of `name`'s spread over the epoch, or `()`.

    Example:

    ```python
    spread_names("grad_norm")  # ("grad_norm_min", "grad_norm_mean", "grad_norm_max")
    ```
    """
    return tuple(f"{name}_{part}" for part in SPREAD.get(name, ()))


# Every name SafeDistributedModel logs with its update statistics, each
# statistic followed by its spread.
LOG_NAMES = tuple(n for name in STATISTICS for n in (name, *spread_names(name)))
# The Dashboard's tags: `PREFIX/<name>`, in the TensorBoard run `<log_dir>/RUN`.
PREFIX = "safe_distributed"
RUN = "safe_distributed"
# Its per-update tags, `UPDATE_PREFIX/<name>` for each statistic (no spread),
# on the update axis.
UPDATE_PREFIX = f"{PREFIX}/update"

# What each value is and how to read it (TensorBoard shows it under the chart);
# `{which}` is the update the value belongs to.
_WHAT = {
    "grad_norm": "Global L2 norm of the all-reduced gradient of {which}, before clipping",
    "clip_rate": "Share of the epoch's applied updates that clipping changed (0 to 1), {which}",
    "skipped_updates": (
        "Updates skipped since fit() began because the reduced gradient or loss was not "
        "finite (weights and optimizer state untouched), {which}"
    ),
    "samples_per_update": "Samples behind {which}, all replicas and micro-batches together",
}
_READ = {
    "grad_norm": "A steady climb precedes divergence; a spike is an outlier batch.",
    "clip_rate": "Near 1, the clip threshold, not the learning rate, sets the step size.",
    "skipped_updates": (
        "Any rise is worth a look; under a LossScaleOptimizer a few early skips are the "
        "loss scale settling."
    ),
    "samples_per_update": (
        "Below batch_size x gradient_accumulation_steps only for an epoch's partial last group."
    ),
}
_PART = {"min": "Smallest", "mean": "Mean", "max": "Largest"}
_SETTINGS = (
    "Read with smoothing 0 and 'Ignore outliers in chart scaling' off, which otherwise "
    "hide and crop spikes."
)


def description(name, per_update=False):
    """The chart description of the log name `name` (a statistic or a spread).

    Args:
        name: a name of `LOG_NAMES`.
        per_update: whether the value is the Dashboard's per-update one
            (step: the update's index) rather than the epoch's (step: the epoch).

    Returns:
        The text: what the value is, its step, how to read it.

    Example:

    ```python
    description("grad_norm", per_update=True)  # "Global L2 norm of ..., of this update. ..."
    ```
    """
    base, _, part = name.rpartition("_")
    if base in SPREAD and part in SPREAD[base]:
        each = _WHAT[base].format(which="each")
        what = f"{_PART[part]} over the epoch's applied updates of: {each[0].lower()}{each[1:]}"
        read = _READ[base]
    else:
        which = {
            "grad_norm": ("this update", "the epoch's last update"),
            "samples_per_update": ("this update", "the epoch's last update"),
        }.get(name, ("up to this update", "at the epoch's end"))
        what = _WHAT[name].format(which=which[0] if per_update else which[1])
        read = _READ[name]
    step = (
        "Step: the update's index since fit() began, from 1, skipped updates included."
        if per_update
        else "Step: the epoch, from 0."
    )
    return f"{what}. {step} {read} {_SETTINGS}"
