"""The NaN onset detector.

- `probe`: the in-step checks a `SafeDistributedModel` builds into its train
  step when a detector asks (`request_from`, `NaNProbe`), and the host-side
  decoding of their flags;
- `locate` and `replay`: after an onset, which replica, tensor and layer;
- `report`: the report's fields, paragraph, files and findings;
- `callback`: `NaNOnsetDetector`, exported as
  `keras_safe_dist.callbacks.NaNOnsetDetector`.

The model depends on `request_from` and `NaNProbe` only; nothing here is
imported by the model beyond them.
"""

from keras_safe_dist.nan.probe import NaNProbe
from keras_safe_dist.nan.probe import ProbeRequest
from keras_safe_dist.nan.probe import request_from

__all__ = ["NaNProbe", "ProbeRequest", "request_from"]
