"""A replica's share of a batch, which may hold no samples.

When a batch has fewer samples than there are replicas, some replicas get an
empty share. Stock Keras then fails in kernels that refuse an empty batch
(convolutions), and BatchNormalization computes NaN batch statistics that
stay in that replica's moving averages for good. `SafeDistributedModel` runs
the forward pass of an empty share on one sample of zeros instead, keeps none
of it (the sample's outputs are sliced away, its loss, denominator and sample
count are multiplied by 0, synchronized BatchNormalization leaves it out of
the batch statistics it sums across replicas), and puts back the
non-trainable state the pass changed on this replica alone (moving
statistics of unsynchronized layers, seed generators). An empty share
therefore contributes exactly nothing: no gradient, no loss, no state.
"""

import contextlib

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist.backend.tensorflow import _compat as _tf_compat


class EmptyShareGuard:
    """Runs a model's forward pass so that an empty share contributes nothing.

    Args:
        model: the `keras.Model` whose forward pass is guarded. On a single
            replica no share is ever empty and the guard does nothing.
    """

    def __init__(self, model):
        self.model = model
        self.active = model.distribute_strategy.num_replicas_in_sync > 1
        self.synchronized = [
            layer
            for layer in _compat.flatten_layers(model)
            if getattr(layer, "synchronized", False) is True
        ]

    def forward(self, x, call):
        """Returns `(y_pred, keep)`: `call(x)` and 1.0, or 0.0 for an empty share.

        Args:
            x: the replica's share of the inputs.
            call: runs the model's forward pass on inputs like `x`.
        """
        if not self.active:
            return call(x), None
        samples = _samples(x)
        if samples is None or not _paddable(x):
            return call(x), None
        empty = tf.equal(samples, 0)
        pad = tf.cast(empty, samples.dtype)
        # Read before the forward pass; TensorFlow orders the reads of a
        # variable before the assignments that follow them in the step.
        state = [
            (v, tf.identity(v.value))
            for v in _local_state(self.model, self.synchronized)
        ]
        padded = keras.tree.map_structure(lambda t: _pad(t, pad), x)
        if self.synchronized:
            # The moments are the same on every replica, so are the moving
            # statistics they update: those are kept on an empty share too.
            excluded = _tf_compat.padding_left_out_of_synchronized_moments(pad)
        else:
            excluded = contextlib.nullcontext()
        with excluded:
            y_pred = call(padded)
        y_pred = keras.tree.map_structure(lambda t: _first(t, samples), y_pred)
        for variable, before in state:
            variable.assign(tf.where(empty, before, variable.value))
        return y_pred, 1.0 - tf.cast(pad, tf.float32)


def _samples(x):
    for t in keras.tree.flatten(x):
        if isinstance(t, tf.SparseTensor):
            return tf.cast(t.dense_shape[0], tf.int32)
        if isinstance(t, tf.Tensor) and t.shape.rank:
            return tf.shape(t)[0]
    return None


def _paddable(x):
    return all(
        t is None
        or isinstance(t, tf.SparseTensor)
        or (isinstance(t, tf.Tensor) and t.shape.rank and t.dtype != tf.string)
        for t in keras.tree.flatten(x)
    )


def _pad(t, pad):
    """`t` with `pad` (0 or 1) rows of zeros appended."""
    if t is None:
        return None
    if isinstance(t, tf.SparseTensor):
        shape = t.dense_shape + tf.one_hot(0, tf.size(t.dense_shape), dtype=tf.int64) * tf.cast(pad, tf.int64)
        return tf.SparseTensor(t.indices, t.values, shape)
    rows = tf.zeros(tf.concat([[pad], tf.shape(t)[1:]], 0), t.dtype)
    return tf.concat([t, rows], 0)


def _first(t, samples):
    """The first `samples` rows of an output, with its Keras mask."""
    if not isinstance(t, tf.Tensor) or not t.shape.rank:
        return t
    mask = _compat.keras_mask(t)
    kept = t[:samples]
    if mask is not None:
        _compat.set_keras_mask(kept, mask[:samples])
    return kept


def _local_state(model, synchronized):
    """Non-trainable variables each replica assigns from its own share alone.

    Those with no aggregation, except the moving statistics of `synchronized`
    layers, which follow statistics summed over every replica.
    """
    shared = {id(v) for layer in synchronized for v in layer.non_trainable_variables}
    return [
        v
        for v in model.non_trainable_variables
        if (v.aggregation == "none" or v.synchronization == "on_read")
        and id(v) not in shared
    ]
