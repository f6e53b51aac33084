"""Probe: the Keras 3.7-3.9 NaN loss under MirroredStrategy, and the old `mean` default.

Keras 3.7-3.9 logged a NaN loss under MirroredStrategy even for a model that
only copies its input: the loss tracker's `sum`-aggregated variables were
written on every step across replicas and overflowed (see `sum-aggregation`
for the mechanism). The same releases made `aggregation="mean"` the default
of every `keras.Variable`, which mis-reduces optimizer state. This probe
trains an Identity model with MSE for enough steps to overflow float32 that
way (the exact loss is 1.0), and reads the default aggregation of a new
variable. The figure is the epoch loss.
"""

import math

import keras
import numpy as np

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]

# Doubling per step overflows float32 (max ~2**128) well within this.
STEPS = 160


def run(strategy):
    replicas = strategy.num_replicas_in_sync
    x = np.random.default_rng(0).normal(size=(STEPS * replicas, 4)).astype("float32")

    def side(cls):
        with strategy.scope():
            inputs = keras.Input((4,))
            model = cls(inputs, keras.layers.Identity()(inputs))
            model.compile(optimizer=_tiny.sgd(), loss="mse")
            default = keras.Variable(0.0, trainable=False).aggregation
        with _tiny.quiet():
            history = model.fit(x, x + 1.0, batch_size=replicas, epochs=1, verbose=0)
        loss = float(history.history["loss"][-1])
        if default == "mean":
            return Side(False, f"loss {loss}; keras.Variable default aggregation 'mean'")
        return Side(math.isfinite(loss), loss)

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))


PROBE = Probe(
    name="identity-nan",
    checks=(
        f"Identity model, MSE, {STEPS} steps (exact loss 1.0): loss finite or not, "
        "and keras.Variable's default aggregation not 'mean' (figure: epoch loss)"
    ),
    run=run,
)
