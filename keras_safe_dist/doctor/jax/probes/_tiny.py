"""The tiny model on JAX: `shared_probes.tiny.Tiny` over a `keras.distribution.DataParallel`.

A place here is the probes' `DataParallel` over the devices, or None for
stock Keras on one device (the reference). The model, data and measurement
are `shared_probes/tiny.py`'s, the TensorFlow probes' too, re-exported for
the JAX probes.
"""

import contextlib

from keras_safe_dist.doctor.shared_probes.tiny import SEED
from keras_safe_dist.doctor.shared_probes.tiny import compiled_mlp
from keras_safe_dist.doctor.shared_probes.tiny import data
from keras_safe_dist.doctor.shared_probes.tiny import fit_update
from keras_safe_dist.doctor.shared_probes.tiny import quiet
from keras_safe_dist.doctor.shared_probes.tiny import relative_deviation
from keras_safe_dist.doctor.shared_probes.tiny import sgd

__all__ = [
    "SEED",
    "data",
    "devices",
    "mlp",
    "on",
    "one_device",
    "quiet",
    "relative_deviation",
    "sgd",
    "update",
]


def devices(distribution):
    """How many devices `distribution` spreads a batch over (1 for None)."""
    return 1 if distribution is None else len(distribution.device_mesh.devices.ravel())


def one_device():
    """None: no distribution, stock Keras on one device."""
    return None


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
        model = compiled_mlp(cls, optimizer, **options)
        if weights is not None:
            model.set_weights(weights)
    return model


def update(model, distribution, x, y, batch_size, from_batch=0):
    """Fits one epoch under `distribution`; returns the change of the weights after batch `from_batch - 1`."""
    with on(distribution):
        return fit_update(model, x, y, batch_size, from_batch)
