"""Probe (JAX): the optimizer's `global_clipnorm` under `DataParallel`.

On TensorFlow stock Keras clips each replica's gradient before the
all-reduce. On JAX every array is global: XLA sums the gradient across the
devices inside the step, and the optimizer clips the whole gradient once, as
on one device, so stock Keras is correct here and both sides should match.
The figure is the norm of one SGD update divided by the norm of the update
on one device with the whole batch: 1.0 is correct.
"""

import keras
import numpy as np

from keras_safe_dist.doctor.jax.probes import _tiny
from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]

CLIPNORM = 0.5


def run(distribution):
    x, y = _tiny.data(4 * _tiny.devices(distribution))
    batch = len(x)
    clipped = lambda: _tiny.sgd(global_clipnorm=CLIPNORM)  # noqa: E731
    reference = _tiny.mlp(keras.Model, None, optimizer=clipped)
    start = reference.get_weights()
    expected = np.linalg.norm(_tiny.update(reference, None, x, y, batch))

    def stock():
        model = _tiny.mlp(keras.Model, distribution, weights=start, optimizer=clipped)
        return _ratio(np.linalg.norm(_tiny.update(model, distribution, x, y, batch)) / expected)

    def safe():
        model = _tiny.mlp(
            SafeDistributedModel, distribution, weights=start, global_clipnorm=CLIPNORM
        )
        return _ratio(np.linalg.norm(_tiny.update(model, distribution, x, y, batch)) / expected)

    return measure(stock), measure(safe)


def _ratio(value):
    return Side(abs(value - 1.0) <= TOLERANCE, round(float(value), 6))


PROBE = Probe(
    name="clip-before-allreduce",
    checks=(
        f"global_clipnorm={CLIPNORM}: norm of one update / norm of the one-device update "
        "(1.0 is correct; stock clips the global gradient on JAX too)"
    ),
    run=run,
)
