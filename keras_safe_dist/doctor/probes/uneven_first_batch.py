"""Probe: a first batch that splits unevenly across the replicas.

Stock Keras builds the model from the first distributed batch by
MEAN-reducing it across replicas, which fails when the replicas' shares
differ in size (a dataset smaller than the batch size, for instance).
SafeDistributedModel builds from one replica's input specs. Crash or not:
the figure is the relative deviation of the update from one device (0 is
correct), or the error.
"""

import keras

from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]


def run(strategy):
    replicas = strategy.num_replicas_in_sync
    # A single batch of replicas + 1 samples, smaller than the batch size.
    x, y = _tiny.data(replicas + 1)
    batch = 4 * replicas
    reference = _tiny.mlp(keras.Model, _tiny.one_device())
    start = reference.get_weights()
    expected = _tiny.update(reference, _tiny.one_device(), x, y, batch)

    def side(cls):
        model = _tiny.mlp(cls, strategy, weights=start)
        value = _tiny.relative_deviation(expected, _tiny.update(model, strategy, x, y, batch))
        return Side(value <= TOLERANCE, value)

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))


PROBE = Probe(
    name="uneven-first-batch",
    checks=(
        "fit whose first batch splits unevenly: crash or not (figure: relative "
        "deviation of the update from one device, 0 is correct)"
    ),
    run=run,
)
