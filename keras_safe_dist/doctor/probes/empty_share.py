"""Probe: a batch with fewer samples than replicas leaves a replica's share empty.

With `replicas + 1` samples in batches of `replicas`, the last batch holds one
sample and every replica but the first gets none. Stock Keras then computes
BatchNormalization statistics of an empty batch (0 / 0): those replicas'
moving mean and variance turn NaN for good, and so do their predictions.
SafeDistributedModel runs an empty share on one sample of zeros, keeps none
of it and puts its state back. The figure is the number of replicas whose
moving statistics are non-finite after one epoch (0 is correct), or the error.
"""

import keras
import numpy as np

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]


def build(cls, strategy):
    with strategy.scope():
        inputs = keras.Input((4,))
        hidden = keras.layers.BatchNormalization(name="norm")(keras.layers.Dense(3)(inputs))
        model = cls(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=_tiny.sgd(), loss="mse")
    return model


def run(strategy):
    replicas = strategy.num_replicas_in_sync
    x, y = _tiny.data(replicas + 1)

    def side(cls):
        model = build(cls, strategy)
        with _tiny.quiet():
            model.fit(x, y, batch_size=replicas, epochs=1, shuffle=False, verbose=0)
        norm = model.get_layer("norm")
        broken = sum(
            not all(np.isfinite(value.numpy()).all() for value in values)
            for values in zip(
                *(
                    strategy.experimental_local_results(v.value)
                    for v in norm.non_trainable_variables
                )
            )
        )
        return Side(broken == 0, broken)

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))


PROBE = Probe(
    name="empty-share",
    checks=(
        "a last batch of 1 sample (other replicas get none) through "
        "BatchNormalization: replicas whose moving statistics turned NaN "
        "(0 is correct)"
    ),
    run=run,
)
