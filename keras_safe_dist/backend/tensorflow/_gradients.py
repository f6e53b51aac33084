"""Gradient arithmetic for TensorFlow's update: sparse gradients stay sparse, low precision is widened.

An embedding's gradient is a `tf.IndexedSlices`; each function here keeps it one
where the result can be (scaling, dividing, clipping values, casting), and
computes float16 and bfloat16 values in float32, where a norm or a factor
cannot overflow.
"""

import keras
import tensorflow as tf

__all__ = [
    "add", "all_reduce_sum", "cast", "clip_values", "divide", "global_norm", "is_low_precision",
    "restored", "scale", "summed_rows", "unique_slices",
]


def is_low_precision(dtype):
    return keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")


def cast(grad, dtype):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)


def global_norm(tensors):
    """The global norm, in float64 if any tensor is float64, else in float32.

    float16 and bfloat16 gradients are squared in float32, where their norm
    cannot overflow; an overflow would read as a non-finite update.
    """
    if not tensors:
        return tf.zeros(())
    dtype = tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32
    squares = [tf.reduce_sum(tf.square(tf.cast(t, dtype))) for t in tensors]
    return tf.sqrt(tf.add_n(squares))


def restored(grad, factor):
    return grad if factor is None else scale(grad, factor)


def unique_slices(grad):
    """A sparse gradient with each row once (repeated rows summed)."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    rows, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, grad.dense_shape)


def summed_rows(grad):
    """The values whose norm is the gradient's norm (None stays None)."""
    if isinstance(grad, tf.IndexedSlices):
        return unique_slices(grad).values
    return grad


def scale(grad, factor):
    """`grad * factor`, computed in at least float32 (a float16 factor may overflow)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            scale(grad.values, factor), grad.indices, grad.dense_shape
        )
    if is_low_precision(grad.dtype):
        return tf.cast(tf.cast(grad, tf.float32) * tf.cast(factor, tf.float32), grad.dtype)
    return grad * tf.cast(factor, grad.dtype)


def divide(grad, divisor):
    """`grad / divisor` (0 where divisor is 0), in at least float32."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            divide(grad.values, divisor), grad.indices, grad.dense_shape
        )
    dtype = tf.float32 if is_low_precision(grad.dtype) else grad.dtype
    quotient = tf.math.divide_no_nan(tf.cast(grad, dtype), tf.cast(divisor, dtype))
    return tf.cast(quotient, grad.dtype)


def clip_values(grad, limit):
    if isinstance(grad, tf.IndexedSlices):
        values = tf.clip_by_value(grad.values, -limit, limit)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return tf.clip_by_value(grad, -limit, limit)


def add(grad, extra):
    """`grad + extra`, either of which may be None; a sum with a dense term is dense."""
    if extra is None:
        return grad
    extra = tf.convert_to_tensor(extra)
    if grad is None:
        return extra
    grad = tf.convert_to_tensor(grad)
    return grad + tf.cast(extra, grad.dtype)


def all_reduce_sum(values):
    """Replica context: `values` summed across replicas, one all-reduce per dtype.

    A batched all-reduce packs its tensors together, which needs one dtype.
    """
    context = tf.distribute.get_replica_context()
    dtypes = []
    for value in values:
        if value.dtype not in dtypes:
            dtypes.append(value.dtype)
    reduced = [None] * len(values)
    for dtype in dtypes:
        where = [i for i, value in enumerate(values) if value.dtype == dtype]
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [values[i] for i in where])
        for i, value in zip(where, summed):
            reduced[i] = value
    return reduced
