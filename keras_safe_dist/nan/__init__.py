"""The NaN onset detector.

- `flags`: what a detector asks of the train step (`ProbeRequest`,
  `request_from`) and the decoding of the flags the step returns;
- `replay`: what a replay found, and the layer-call recording it uses;
- `report`: the report's fields, paragraph, files and findings;
- `callback`: `NaNOnsetDetector`, exported as
  `keras_safe_dist.callbacks.NaNOnsetDetector`.

Each backend's in-step checks, replay and location of the bad micro-batch
are in its own folder: `backend/tensorflow/nan_probe.py`, `nan_replay.py`
and `nan_locate.py`; `backend/jax/nan_locate.py`. The model depends on
`request_from` and `record_in_step` only. Nothing here imports TensorFlow or jax.
"""

from keras_safe_dist.nan.flags import ProbeRequest
from keras_safe_dist.nan.flags import record_in_step
from keras_safe_dist.nan.flags import request_from

__all__ = ["ProbeRequest", "record_in_step", "request_from"]
