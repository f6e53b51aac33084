"""The update statistics' names, shared by the `Dashboard` and `report` (no TensorFlow)."""

__all__ = ["PREFIX", "RUN", "STATISTICS"]

# log name: chart title
STATISTICS = {
    "grad_norm": "gradient norm (reduced, before clipping)",
    "clip_rate": "clip rate (share of updates clipped)",
    "skipped_updates": "skipped non-finite updates",
    "samples_per_update": "samples per update",
}
# The Dashboard's tags: `PREFIX/<name>`, in the TensorBoard run `<log_dir>/RUN`.
PREFIX = "safe_distributed"
RUN = "safe_distributed"
