"""Probe (JAX): accumulation over micro-batches of uneven size.

Stock Keras's optimizer `gradient_accumulation_steps` averages the
micro-batch gradients with equal weights, so a short last micro-batch counts
as much as a full one (on JAX it runs under `DataParallel`, unlike on
TensorFlow's MirroredStrategy). SafeDistributedModel weights every sample
equally. Both sides run on the devices with micro-batches of 8 x devices,
8 x devices and 1 x devices samples (16, 16, 2 on two devices); the figure
is the relative deviation of the one update from one device's update on the
whole batch: 0 is correct.
"""

import keras

from keras_safe_dist.doctor.jax.probes import _tiny
from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]

STEPS = 3


def run(distribution):
    devices = _tiny.devices(distribution)
    micro_batch = 8 * devices
    # Every micro-batch splits evenly: only the weighting differs.
    x, y = _tiny.data((STEPS - 1) * micro_batch + devices)
    reference = _tiny.mlp(keras.Model, None)
    start = reference.get_weights()
    expected = _tiny.update(reference, None, x, y, len(x))

    def stock():
        model = _tiny.mlp(
            keras.Model, distribution, weights=start,
            optimizer=lambda: _tiny.sgd(gradient_accumulation_steps=STEPS),
        )
        return _deviation(expected, _tiny.update(model, distribution, x, y, micro_batch))

    def safe():
        model = _tiny.mlp(
            SafeDistributedModel, distribution, weights=start,
            gradient_accumulation_steps=STEPS,
        )
        return _deviation(expected, _tiny.update(model, distribution, x, y, micro_batch))

    return measure(stock), measure(safe)


def _deviation(expected, actual):
    value = _tiny.relative_deviation(expected, actual)
    return Side(value <= TOLERANCE, value)


PROBE = Probe(
    name="uneven-accumulation",
    checks=(
        f"accumulation over {STEPS} micro-batches of 8, 8 and 1 x devices samples (stock: "
        "the optimizer's gradient_accumulation_steps): relative deviation of the update "
        "from one device on the whole batch (0 is correct)"
    ),
    run=run,
)
