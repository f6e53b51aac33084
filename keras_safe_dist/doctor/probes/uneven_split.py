"""Probe: a batch that splits unevenly across the replicas.

Stock Keras scales each replica's mean loss by `1 / replicas`, so when a
batch splits unevenly (the last batch of an epoch, typically) the samples on
the emptier replicas weigh more. SafeDistributedModel divides the reduced
loss numerator by the global number of samples. The figure is the relative
deviation of the update on the uneven batch from the one-device update: 0
is correct.
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
    batch = 4 * replicas
    # The first batch splits evenly (stock crashes otherwise, see
    # `uneven-first-batch`); the second has replicas + 1 samples: one
    # replica gets two, the others one.
    x, y = _tiny.data(batch + replicas + 1)
    reference = _tiny.mlp(keras.Model, _tiny.one_device())
    start = reference.get_weights()
    expected = _tiny.update(reference, _tiny.one_device(), x, y, batch, from_batch=1)

    def side(cls):
        model = _tiny.mlp(cls, strategy, weights=start)
        value = _tiny.relative_deviation(
            expected, _tiny.update(model, strategy, x, y, batch, from_batch=1)
        )
        return Side(value <= TOLERANCE, value)

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))


PROBE = Probe(
    name="uneven-replica-split",
    checks=(
        "a batch of replicas+1 samples (one replica gets 2): relative deviation of "
        "its update from one device (0 is correct)"
    ),
    run=run,
)
