"""The update statistics' names, shared by the `Dashboard` and `report` (no TensorFlow)."""

__all__ = ["LOG_NAMES", "PREFIX", "RUN", "SPREAD", "STATISTICS", "spread_names"]

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
