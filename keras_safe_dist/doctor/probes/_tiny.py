"""The tiny model, data and measurements the in-process probes share.

Every probe builds the same 4-3-1 tanh MLP from a fixed seed, trains it with
plain SGD on fixed regression data, and compares one optimizer update (the
change of the weights) with a reference update from stock Keras on one
device. Sizes scale with the number of replicas so that every probe splits
its batches the way it means to on any replica count.
"""


import keras
import numpy as np
import tensorflow as tf

from keras_safe_dist.doctor._shared import data
from keras_safe_dist.doctor._shared import quiet
from keras_safe_dist.doctor._shared import sgd

__all__ = [
    "SEED",
    "data",
    "mlp",
    "one_device",
    "quiet",
    "relative_deviation",
    "sgd",
    "update",
]

SEED = 7


def mlp(cls, strategy, optimizer=None, weights=None, **options):
    """A compiled 4-3-1 MLP of class `cls`, built under `strategy`.

    Args:
        cls: `keras.Model` or `SafeDistributedModel`.
        strategy: the strategy whose scope holds the variables.
        optimizer: a function returning the optimizer, called in the
            strategy's scope (its variables belong there); defaults to
            `SGD(0.1)`.
        weights: initial weights; defaults to those of the fixed seed.
        **options: passed to `cls`.
    """
    with strategy.scope():
        keras.utils.set_random_seed(SEED)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3, activation="tanh", name="hidden")(inputs)
        model = cls(inputs, keras.layers.Dense(1, name="out")(hidden), **options)
        model.compile(optimizer=(optimizer or sgd)(), loss="mse")
    if weights is not None:
        model.set_weights(weights)
    return model


def one_device():
    """TensorFlow's default strategy: stock Keras on one device."""
    return tf.distribute.get_strategy()


def update(model, x, y, batch_size, from_batch=0):
    """Fits one epoch; returns the change of the weights after batch `from_batch - 1`."""
    marker = _WeightsAfter(from_batch - 1)
    before = model.get_weights()
    with quiet():
        model.fit(
            x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
            callbacks=[marker],
        )
    start = marker.weights if from_batch > 0 else before
    return np.concatenate(
        [(after - first).ravel() for after, first in zip(model.get_weights(), start)]
    )


def relative_deviation(expected, actual):
    """`||actual - expected|| / ||expected||`."""
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))


class _WeightsAfter(keras.callbacks.Callback):
    """Keeps a copy of the weights after batch `batch` (a host read, probes only)."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch
        self.weights = None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.weights = self.model.get_weights()
