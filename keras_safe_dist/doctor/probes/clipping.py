"""Probe: optimizer clipping applied before the cross-replica all-reduce.

Stock Keras clips each replica's share of the gradient (`global_clipnorm` on
the optimizer) before the replicas' gradients are summed, so the update can
be up to `replicas` times longer than the clipped norm. SafeDistributedModel
clips the reduced gradient once. The figure is the norm of one SGD update
divided by the norm of the update stock Keras makes on one device with the
whole batch: 1.0 is correct.
"""

import keras
import numpy as np

from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]

CLIPNORM = 0.5


def run(strategy):
    replicas = strategy.num_replicas_in_sync
    x, y = _tiny.data(4 * replicas)
    batch = len(x)
    reference = _tiny.mlp(
        keras.Model, _tiny.one_device(),
        optimizer=lambda: _tiny.sgd(global_clipnorm=CLIPNORM),
    )
    start = reference.get_weights()
    expected = np.linalg.norm(_tiny.update(reference, x, y, batch))

    def stock():
        model = _tiny.mlp(
            keras.Model, strategy, weights=start,
            optimizer=lambda: _tiny.sgd(global_clipnorm=CLIPNORM),
        )
        return _ratio(np.linalg.norm(_tiny.update(model, x, y, batch)) / expected)

    def safe():
        model = _tiny.mlp(
            SafeDistributedModel, strategy, weights=start, global_clipnorm=CLIPNORM
        )
        return _ratio(np.linalg.norm(_tiny.update(model, x, y, batch)) / expected)

    return measure(stock), measure(safe)


def _ratio(value):
    return Side(abs(value - 1.0) <= TOLERANCE, round(float(value), 6))


PROBE = Probe(
    name="clip-before-allreduce",
    checks=(
        f"global_clipnorm={CLIPNORM}: norm of one update / norm of the one-device "
        "update (1.0 is correct)"
    ),
    run=run,
)
