"""The contract between `SafeDistributedModel` and `NaNOnsetDetector`, as one object.

The model owns a `DetectorLink` and fills it as it builds its step; the
detector reads it, and nothing else of the model's private state. A model that
is not ours has none (`link_of` returns None): the detector then works from
the logs and the weights alone (docs/nan_detector.md, "a plain keras.Model").
"""

__all__ = ["DetectorLink", "link_of"]


class DetectorLink:
    """What a `SafeDistributedModel` gives the `NaNOnsetDetector` watching it.

    Attributes:
        probe: TensorFlow: the in-step probe the model built for the
            detector's request (`backend/tensorflow/nan_probe.NaNProbe`: the
            step's flags, the batches kept for the replay, the weights
            restored), or None.
        watch: JAX: the step's record on the device
            (`backend/jax/nan_watch.NaNWatch`: the onset, the hold after it,
            the batches and weights kept), or None.
        statistics: the update statistics' vector of the current step (a
            variable, read at epoch ends only), or None before the first
            step is built.
        fit_arrays: during `fit()`, the arrays it was given (references, not
            copies), which name a bad sample's row; None for a dataset or
            outside `fit()`.
    """

    def __init__(self):
        self.probe = None
        self.watch = None
        self.statistics = None
        self.fit_arrays = None

    def __repr__(self):
        held = [name for name in ("probe", "watch", "statistics", "fit_arrays") if getattr(self, name) is not None]
        return f"DetectorLink(holds: {', '.join(held) or 'nothing'})"


def link_of(model):
    """The `DetectorLink` of `model`, or None for a model that is not a `SafeDistributedModel`."""
    link = getattr(model, "_nan_link", None)
    return link if isinstance(link, DetectorLink) else None
