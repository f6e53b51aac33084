"""The tiny model, data and measurements the JAX probes share.

The same 4-3-1 tanh MLP, seed, SGD and regression data as the TensorFlow
probes' `probes/_tiny.py`, built and trained under a
`keras.distribution.DataParallel` (the probes' devices) or with no
distribution (one device, the reference).
"""

import contextlib

import keras
import numpy as np

# The same data, optimizer and quieting as the TensorFlow probes.
from keras_safe_dist.doctor._shared import data
from keras_safe_dist.doctor._shared import quiet
from keras_safe_dist.doctor._shared import sgd

__all__ = [
    "SEED",
    "data",
    "devices",
    "mlp",
    "on",
    "quiet",
    "relative_deviation",
    "sgd",
    "update",
]

SEED = 7


def devices(distribution):
    """How many devices `distribution` spreads a batch over (1 for None)."""
    return 1 if distribution is None else len(distribution.device_mesh.devices.ravel())


@contextlib.contextmanager
def on(distribution):
    """`distribution`'s scope, or nothing for None (one device)."""
    if distribution is None:
        yield
        return
    with distribution.scope():
        yield


def mlp(cls, distribution, optimizer=None, weights=None, **options):
    """A compiled 4-3-1 MLP of class `cls`, its variables laid out by `distribution`.

    Args:
        cls: `keras.Model` or `SafeDistributedModel`.
        distribution: a `DataParallel`, or None for one device.
        optimizer: a function returning the optimizer; defaults to `SGD(0.1)`.
        weights: initial weights; defaults to those of the fixed seed.
        **options: passed to `cls`.
    """
    with on(distribution):
        keras.utils.set_random_seed(SEED)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3, activation="tanh", name="hidden")(inputs)
        model = cls(inputs, keras.layers.Dense(1, name="out")(hidden), **options)
        model.compile(optimizer=(optimizer or sgd)(), loss="mse")
        if weights is not None:
            model.set_weights(weights)
    return model


def update(model, distribution, x, y, batch_size):
    """Fits one epoch under `distribution`; returns the change of the weights."""
    before = model.get_weights()
    with on(distribution), quiet():
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return np.concatenate(
        [(after - first).ravel() for after, first in zip(model.get_weights(), before)]
    )


def relative_deviation(expected, actual):
    """`||actual - expected|| / ||expected||`."""
    expected, actual = np.asarray(expected), np.asarray(actual)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))

