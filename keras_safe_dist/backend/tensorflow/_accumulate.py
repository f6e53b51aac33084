"""Replica-local sums of micro-batch gradients: dense, or row by row.

A dense gradient is summed into a variable of its shape. A sparse gradient
(the `tf.IndexedSlices` an Embedding gets) cannot be summed and stay exact:
an optimizer that treats rows one by one, as Keras's Adam, RMSprop and
Adagrad do when they square a sparse gradient, squares each row of one big
batch's gradient *before* repeated rows are added up. So its rows are kept
one by one across the group instead, and the update sees the same rows, in
the same number, as stock Keras on one device sees for one big batch. They
cost the memory of that big batch's sparse gradient, and nothing before an
Embedding's first gradient: both sums of an Embedding's table are sized
when first written.
"""

import warnings

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist.update import _loss

_LOCAL = dict(
    trainable=False,
    synchronization=tf.VariableSynchronization.ON_READ,
    aggregation=tf.VariableAggregation.SUM,
)


def row_variables(model):
    """Ids of the trainable variables whose gradient is usually sparse (Embedding tables)."""
    return {
        id(layer.embeddings)
        for layer in _compat.flatten_layers(model)
        if isinstance(layer, keras.layers.Embedding)
        and getattr(layer, "embeddings", None) is not None
    }


class DenseSum:
    """The sum of one variable's gradients, as a dense tensor.

    Args:
        variable: the trainable variable.
        lazy: size the sum when it is first written (an Embedding's table,
            whose gradient is usually sparse); not under XLA.
        chosen: the model's `accumulation_dtype` (see `_loss.accumulator_dtype`).
    """

    def __init__(self, variable, lazy=False, chosen=None):
        self.shape = tuple(variable.shape)
        self.lazy = lazy
        dtype = _loss.accumulator_dtype(variable.dtype, chosen)
        if lazy:
            initial = tf.zeros([0], dtype)
            self.variable = tf.Variable(
                initial, shape=tf.TensorShape(None), name="safe_dist_accumulator", **_LOCAL
            )
        else:
            self.variable = tf.Variable(
                tf.zeros(self.shape, dtype), name="safe_dist_accumulator", **_LOCAL
            )
        self.dtype = self.variable.dtype

    def prepare(self, grad):
        return tf.cast(tf.convert_to_tensor(grad), self.dtype)

    def start(self, grad):
        self.variable.assign(grad)

    def add(self, grad):
        self.variable.assign_add(grad)

    def read(self):
        value = self.variable.read_value()
        return tf.reshape(value, self.shape) if self.lazy else value


class RowSum:
    """The rows of one variable's sparse gradients, kept one by one.

    Args:
        variable: the trainable variable (an Embedding's table).
        chosen: the model's `accumulation_dtype` (see `_loss.accumulator_dtype`).
    """

    def __init__(self, variable, chosen=None):
        self.shape = tuple(variable.shape)
        dtype = _loss.accumulator_dtype(variable.dtype, chosen)
        rows = tf.TensorShape([None]).concatenate(self.shape[1:])
        self.values = tf.Variable(
            tf.zeros([0, *self.shape[1:]], dtype), shape=rows, name="safe_dist_rows", **_LOCAL
        )
        self.indices = tf.Variable(
            tf.zeros([0], tf.int64), shape=[None], name="safe_dist_row_indices", **_LOCAL
        )
        self.dtype = self.values.dtype

    def prepare(self, grad):
        return tf.IndexedSlices(
            tf.cast(grad.values, self.dtype), tf.cast(grad.indices, tf.int64), grad.dense_shape
        )

    def start(self, grad):
        self.values.assign(grad.values)
        self.indices.assign(grad.indices)

    def add(self, grad):
        self.values.assign(tf.concat([self.values.read_value(), grad.values], 0))
        self.indices.assign(tf.concat([self.indices.read_value(), grad.indices], 0))

    def read(self):
        return tf.IndexedSlices(
            self.values.read_value(),
            self.indices.read_value(),
            tf.constant(self.shape, tf.int64),
        )


class SharedRowSum(RowSum):
    """The summed rows of a sparse gradient whose rows are the same in every micro-batch.

    An Embedding looked up with ids that do not depend on the sample (a
    position table over `arange(P)`, shared by every sample): one device's
    gradient has one row per id, summed over the batch, so the micro-batches'
    rows are summed row by row, keeping one device's rows.

    Args:
        variable: the trainable variable (an Embedding's table).
    """

    def add(self, grad):
        self.values.assign_add(grad.values)


class Accumulators:
    """One sum per trainable variable of a model, chosen by its gradient's kind.

    Args:
        model: the model whose trainable variables get sums.
        rows: whether Embedding tables may keep their rows (not when XLA
            compiles the whole step: it cannot resize a variable).
    """

    def __init__(self, model, rows):
        self.names = [v.path for v in model.trainable_weights]
        row_ids = row_variables(model) if rows else set()
        chosen = model.accumulation_dtype
        self.dense = [
            DenseSum(v, lazy=id(v) in row_ids, chosen=chosen) for v in model.trainable_weights
        ]
        self.rows = [
            RowSum(v, chosen) if id(v) in row_ids else None for v in model.trainable_weights
        ]
        self.shared = [
            SharedRowSum(v, chosen) if id(v) in row_ids else None
            for v in model.trainable_weights
        ]
        # Set while the train step is traced: which sum each variable uses.
        self.row_wise = set()
        self.shared_rows = set()
        self.no_gradient = set()
        self.warned = False

    def pairs(self, grads, shared_rows=frozenset()):
        """`(sum, prepared gradient)` for each gradient that is not None.

        Called while the step is traced; records which sums `read()` reads.
        `shared_rows`: indices of the sparse gradients whose rows are the
        same in every micro-batch (`SharedRowSum`).
        """
        self.no_gradient = {i for i, g in enumerate(grads) if g is None}
        self.shared_rows = {i for i in shared_rows if self.shared[i] is not None}
        self.row_wise = {
            i
            for i, g in enumerate(grads)
            if isinstance(g, tf.IndexedSlices) and self.rows[i] is not None
        }
        summed = [
            self.names[i]
            for i, g in enumerate(grads)
            if isinstance(g, tf.IndexedSlices) and i not in self.row_wise
        ]
        if summed and not self.warned:
            self.warned = True
            warnings.warn(
                "SafeDistributedModel adds up the rows of the sparse gradients of "
                f"{summed} across the micro-batches of each update (gathered by a "
                "layer that is not an Embedding, or under a step compiled whole "
                "by XLA). An optimizer that treats rows one by one (Adam, RMSprop, "
                "Adagrad) then differs from one big batch on one device; SGD does "
                "not. Use jit_compile=False, or gradient_accumulation_steps=1 with "
                "a larger batch, where exactness matters.",
                stacklevel=2,
            )
        pairs = []
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            pairs.append((self._sum(i), self._sum(i).prepare(grad)))
        return pairs

    def _sum(self, i):
        if i in self.shared_rows and i in self.row_wise:
            return self.shared[i]
        return self.rows[i] if i in self.row_wise else self.dense[i]

    def read(self):
        """Replica context: each variable's summed gradient (None for none)."""
        return [
            None if i in self.no_gradient else self._sum(i).read() for i in range(len(self.dense))
        ]
