"""The data, optimizer and quieting both doctors' probes share.

TensorFlow's probes (`probes/_tiny.py`) and JAX's (`jax/probes/_tiny.py`) train
the same tiny model on the same data with the same SGD; this module holds what
does not depend on the backend, so JAX's probes import no TensorFlow.
"""

import contextlib
import warnings

import keras
import numpy as np

__all__ = ["LEARNING_RATE", "data", "quiet", "sgd"]

LEARNING_RATE = 0.1


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
