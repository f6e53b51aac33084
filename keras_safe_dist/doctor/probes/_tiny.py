"""The tiny model on TensorFlow: `shared_probes.tiny.Tiny` over a `tf.distribute` strategy.

A place here is a strategy: the probes' MirroredStrategy over the replicas,
or TensorFlow's default strategy for stock Keras on one device (the
reference). The model, data and measurement are `shared_probes/tiny.py`'s,
re-exported for the TensorFlow probes.
"""

import tensorflow as tf

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
    "one_device",
    "quiet",
    "relative_deviation",
    "sgd",
    "update",
]


def devices(strategy):
    """How many replicas `strategy` splits a batch over."""
    return strategy.num_replicas_in_sync


def one_device():
    """TensorFlow's default strategy: stock Keras on one device."""
    return tf.distribute.get_strategy()


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
        model = compiled_mlp(cls, optimizer, **options)
    if weights is not None:
        model.set_weights(weights)
    return model


def update(model, strategy, x, y, batch_size, from_batch=0):
    """Fits one epoch; returns the change of the weights after batch `from_batch - 1`.

    A Keras model on TensorFlow fits under the strategy it was built in,
    wherever `fit` is called: `strategy` (that one) is taken for the
    interface JAX's `_tiny.update` shares, which needs its distribution.
    """
    del strategy
    return fit_update(model, x, y, batch_size, from_batch)
