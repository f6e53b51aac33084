"""Probe (JAX): a batch of one sample on several devices.

With `devices + 1` samples in batches of `devices`, the last batch holds one
sample: every device but one would get none. Keras's JAX trainer cannot
shard it and raises `IndivisibleError`. SafeDistributedModel places it whole
on every device. The model holds a BatchNormalization layer, whose moving
statistics an empty share would turn NaN; the figure is the number of
devices whose copy of those statistics is non-finite after one epoch (0 is
correct), or the error.
"""

import keras
import numpy as np

from keras_safe_dist.doctor.jax.probes import _tiny
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]


def build(cls, distribution):
    with _tiny.on(distribution):
        inputs = keras.Input((4,))
        hidden = keras.layers.BatchNormalization(name="norm")(keras.layers.Dense(3)(inputs))
        model = cls(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=_tiny.sgd(), loss="mse")
    return model


def run(distribution):
    devices = _tiny.devices(distribution)
    x, y = _tiny.data(devices + 1)

    def side(cls):
        model = build(cls, distribution)
        with _tiny.on(distribution), _tiny.quiet():
            model.fit(x, y, batch_size=devices, epochs=1, shuffle=False, verbose=0)
        broken = set()
        for variable in model.get_layer("norm").non_trainable_variables:
            for shard in variable.value.addressable_shards:
                if not np.isfinite(np.asarray(shard.data)).all():
                    broken.add(shard.device)
        return Side(not broken, len(broken))

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))


PROBE = Probe(
    name="empty-share",
    checks=(
        "a last batch of 1 sample (other devices would get none) through "
        "BatchNormalization: devices whose moving statistics are non-finite "
        "(0 is correct), or the error"
    ),
    run=run,
)
