"""Probe: equal-weight accumulation with an uneven last micro-batch.

Stock Keras's `gradient_accumulation_steps` averages the micro-batch
gradients with equal weights, so a short last micro-batch counts as much as
a full one. (It crashes under MirroredStrategy, see `optimizer-accumulation`,
so its side runs on one device.) SafeDistributedModel weights each sample
equally, on the replicas. The figure is the relative deviation of the
update from one big batch with the same samples: 0 is correct.
"""

import keras

from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]

STEPS = 2


def run(strategy):
    replicas = strategy.num_replicas_in_sync
    micro_batch = 4 * replicas
    # One update: a full micro-batch, then one of half its size.
    x, y = _tiny.data(micro_batch + micro_batch // 2)
    reference = _tiny.mlp(keras.Model, _tiny.one_device())
    start = reference.get_weights()
    expected = _tiny.update(reference, x, y, len(x))

    def stock():
        model = _tiny.mlp(
            keras.Model, _tiny.one_device(), weights=start,
            optimizer=lambda: _tiny.sgd(gradient_accumulation_steps=STEPS),
        )
        return _deviation(expected, _tiny.update(model, x, y, micro_batch))

    def safe():
        model = _tiny.mlp(
            SafeDistributedModel, strategy, weights=start,
            gradient_accumulation_steps=STEPS,
        )
        return _deviation(expected, _tiny.update(model, x, y, micro_batch))

    return measure(stock), measure(safe)


def _deviation(expected, actual):
    value = _tiny.relative_deviation(expected, actual)
    return Side(value <= TOLERANCE, value)


PROBE = Probe(
    name="uneven-accumulation",
    checks=(
        f"accumulation over {STEPS} micro-batches, the last half as big: relative "
        "deviation of the update from one big batch (0 is correct; stock on one device)"
    ),
    run=run,
)
