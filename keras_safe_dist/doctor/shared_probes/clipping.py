"""`clip-before-allreduce`, measured once for every backend: the norm of one clipped update.

Both sides take one SGD step with `global_clipnorm=CLIPNORM` on 4 samples per
device, from the same weights; the figure is that update's norm over the
one-device update's norm (1.0 is correct). What stock does on each backend is
in that backend's `clipping.py`.
"""

import keras
import numpy as np

from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.shared_probes import tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["CLIPNORM", "FIGURE", "NAME", "run"]

NAME = "clip-before-allreduce"
CLIPNORM = 0.5
# What the figure is (1.0 is correct); each backend's `checks` text says it.
FIGURE = "norm of one update / norm of the one-device update"


def run(backend, place):
    """Returns `(stock, safe)`: each side's update norm over the one-device update norm.

    Args:
        backend: the backend's `_tiny` module (a `tiny.Tiny`).
        place: where both sides train (the probes' replicas or devices).
    """
    x, y = tiny.data(4 * backend.devices(place))
    batch = len(x)
    clipped = lambda: tiny.sgd(global_clipnorm=CLIPNORM)  # noqa: E731
    one_device = backend.one_device()
    reference = backend.mlp(keras.Model, one_device, optimizer=clipped)
    start = reference.get_weights()
    expected = np.linalg.norm(backend.update(reference, one_device, x, y, batch))

    def norm_ratio(model):
        return _ratio(np.linalg.norm(backend.update(model, place, x, y, batch)) / expected)

    def stock():
        return norm_ratio(backend.mlp(keras.Model, place, weights=start, optimizer=clipped))

    def safe():
        return norm_ratio(
            backend.mlp(SafeDistributedModel, place, weights=start, global_clipnorm=CLIPNORM)
        )

    return measure(stock), measure(safe)


def _ratio(value):
    return Side(abs(value - 1.0) <= TOLERANCE, round(float(value), 6))
