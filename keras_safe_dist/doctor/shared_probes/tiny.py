"""The tiny model, data and update measurement of every backend's probes, and `Tiny`.

Every probe trains the same 4-3-1 tanh MLP from a fixed seed with plain SGD
on fixed regression data, and compares one update (the change of the
weights) with stock Keras's on one device. Where a model trains, its place,
is the backend's: each backend's `_tiny` implements `Tiny` over its places.
"""

import contextlib
import typing
import warnings

import keras
import numpy as np

__all__ = [
    "LEARNING_RATE",
    "SEED",
    "Tiny",
    "compiled_mlp",
    "data",
    "fit_update",
    "quiet",
    "relative_deviation",
    "sgd",
]

LEARNING_RATE = 0.1
SEED = 7


class Tiny(typing.Protocol):
    """What a backend's `_tiny` module offers the shared probes (its module-level functions)."""

    def devices(self, place) -> int:
        """How many devices (replicas) `place` spreads a batch over."""

    def one_device(self):
        """The place of the reference: stock Keras on one device."""

    def mlp(self, cls, place, optimizer=None, weights=None, **options) -> keras.Model:
        """`compiled_mlp(cls, optimizer, **options)` built under `place`, with `weights` if given."""

    def update(self, model, place, x, y, batch_size, from_batch=0) -> np.ndarray:
        """`fit_update(model, x, y, batch_size, from_batch)` run under `place`."""


def data(samples, seed=0):
    """`samples` rows of 4 features and a linear target far from the initial fit."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) * 10.0 + 3.0).astype("float32")
    return x, y


def sgd(**options):
    """Plain SGD with the probes' learning rate and `options`."""
    return keras.optimizers.SGD(LEARNING_RATE, **options)


@contextlib.contextmanager
def quiet():
    """Silences Keras's Python warnings (e.g. a model without trainable weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def compiled_mlp(cls, optimizer=None, **options):
    """The 4-3-1 tanh MLP of class `cls` from the fixed seed, compiled with MSE.

    Call it in the place's scope: the variables are created there.

    Args:
        cls: `keras.Model` or `SafeDistributedModel`.
        optimizer: a function returning the optimizer (its variables belong
            to the scope it is called in); defaults to `SGD(0.1)`.
        **options: passed to `cls`.
    """
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="tanh", name="hidden")(inputs)
    model = cls(inputs, keras.layers.Dense(1, name="out")(hidden), **options)
    model.compile(optimizer=(optimizer or sgd)(), loss="mse")
    return model


def fit_update(model, x, y, batch_size, from_batch=0):
    """Fits one epoch unshuffled; returns the change of the weights, all of them in one vector.

    The change is counted from the weights after batch `from_batch - 1`
    (from the start of the epoch for 0).
    """
    marker = [_WeightsAfter(from_batch - 1)] if from_batch > 0 else []
    before = model.get_weights()
    with quiet():
        model.fit(
            x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=marker
        )
    start = marker[0].weights if marker else before
    return np.concatenate(
        [(after - first).ravel() for after, first in zip(model.get_weights(), start)]
    )


def relative_deviation(expected, actual):
    """`||actual - expected|| / ||expected||` (Euclidean norms; 0 when equal)."""
    expected, actual = np.asarray(expected), np.asarray(actual)
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
