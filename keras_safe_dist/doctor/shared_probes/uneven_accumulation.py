"""`uneven-accumulation`, measured once for every backend: one update over uneven micro-batches.

One update accumulates `steps` micro-batches: `steps - 1` of `full` samples
per device, then one of `last`. Stock Keras (the optimizer's
`gradient_accumulation_steps`) weights the micro-batches equally, so the short
one counts as much as a full one; SafeDistributedModel weights every sample
equally. The figure is `FIGURE` (0 is correct).
"""

import keras

from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.shared_probes import tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["FIGURE", "NAME", "run"]

NAME = "uneven-accumulation"
# What the figure is; each backend's `checks` text says it.
FIGURE = (
    "relative deviation of the update from one device's on the whole batch: "
    "||update - one device's|| / ||one device's||, over all the weights (0 is correct)"
)


def run(backend, place, steps, full, last, stock_on_one_device=False):
    """Returns `(stock, safe)`: each side's relative deviation from one device.

    Args:
        backend: the backend's `_tiny` module (a `tiny.Tiny`).
        place: where SafeDistributedModel trains (the probes' replicas or
            devices), and stock Keras unless `stock_on_one_device`.
        steps: micro-batches per update.
        full: samples per device in each micro-batch but the last.
        last: samples per device in the last micro-batch.
        stock_on_one_device: train stock Keras on one device (where its
            accumulation cannot run on `place`).
    """
    devices = backend.devices(place)
    micro_batch = full * devices
    x, y = tiny.data((steps - 1) * micro_batch + last * devices)
    one_device = backend.one_device()
    reference = backend.mlp(keras.Model, one_device)
    start = reference.get_weights()
    expected = backend.update(reference, one_device, x, y, len(x))

    def stock():
        stock_place = one_device if stock_on_one_device else place
        model = backend.mlp(
            keras.Model, stock_place, weights=start,
            optimizer=lambda: tiny.sgd(gradient_accumulation_steps=steps),
        )
        return _deviation(expected, backend.update(model, stock_place, x, y, micro_batch))

    def safe():
        model = backend.mlp(
            SafeDistributedModel, place, weights=start, gradient_accumulation_steps=steps
        )
        return _deviation(expected, backend.update(model, place, x, y, micro_batch))

    return measure(stock), measure(safe)


def _deviation(expected, actual):
    value = tiny.relative_deviation(expected, actual)
    return Side(value <= TOLERANCE, value)
