"""The non-finite checks' arithmetic, the same in-graph and on the host.

The weights and the inputs are values a user may legitimately make huge, so
their checks report only NaNs and infinities: a float32 `reduce_sum` per
tensor and their total is the fast path (a sum is finite only if every
element is), and only when the total is not finite, which a NaN, an infinity
or a float32 overflow makes it, a `tf.cond` confirms with an exact
`reduce_all(is_finite(...))` per tensor. The result is one term, 0 or NaN,
that cannot overflow the flag's total. The loss and local gradient terms are
the test the update applies to its reduced gradient norm (a squared norm that
overflows float32 counts as non-finite, and the update is skipped). Each of
the three flags is one float32 total of its terms, checked with one
`is_finite`. The fast path uses kernels the train step already runs (the
condition's `Switch` and `Merge` too, when the update's own `tf.cond` skips
non-finite updates): a kernel the step runs nowhere else costs far more than
its arithmetic (on a CPU, a `where` and a segment reduction took 20 to 30
microseconds a step, mostly cold code). Summing `x * 0` instead, which cannot
overflow, costs one more pass over every tensor each step; the condition was
cheaper. The update's reduced gradient norm is checked on the host from the
step's `grad_norm` log; the last update of an epoch (and the epoch-end flush
of a partial accumulation group) is checked by the detector at the epoch end,
with `nan_probe.WeightCheck`.
"""

import tensorflow as tf

from keras_safe_dist.nan.flags import MAX_REPLICAS_FOR_FLOAT32

__all__ = [
    "entry_dtype", "finite_each", "finite_flag", "input_values", "inputs_nonfinite",
    "nonfinite_sum", "sum_term", "tensor_nonfinite", "tensor_terms", "total",
]


def entry_dtype(num_replicas):
    """The dtype of the `nonfinite_replicas` entry: float32 while it is exact."""
    return tf.float32 if num_replicas <= MAX_REPLICAS_FOR_FLOAT32 else tf.float64


def inputs_nonfinite(tensors):
    """Whether a floating input holds a NaN or an infinity (large finite values do not count)."""
    return nonfinite_sum([[finite_flag(input_values(tensors))]], [1.0], tf.float32) > 0


def tensor_nonfinite(tensor):
    """Whether a gradient holds a non-finite value (or its squared norm overflows).

    The same test as the update's reduced gradient norm.
    """
    return nonfinite_sum([tensor_terms([tensor])], [1.0], tf.float32) > 0


def sum_term(tensor):
    if tensor.dtype == tf.float16:
        tensor = tf.cast(tensor, tf.float32)  # a float16 sum overflows past 65504
    return tf.cast(tf.reduce_sum(tensor), tf.float32)


def finite_flag(tensors):
    """0.0 when every element of `tensors` is finite, NaN otherwise; never a false NaN.

    Fast path: the float32 total of one sum per tensor. A sum is finite only
    if every element is, so a finite total settles it. A non-finite total
    (a NaN, an infinity, or finite values whose sum overflows float32) is
    confirmed element by element, in the branch that runs only then. The
    condition holds no collective, so it is safe in replica context.
    """
    if not tensors:
        return tf.zeros(())
    summed = total([sum_term(t) for t in tensors])
    return tf.cond(tf.math.is_finite(summed), lambda: tf.zeros(()), lambda: _exact_flag(tensors))


def _exact_flag(tensors):
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))
    return 0.0 / tf.cast(finite, tf.float32)  # 0 / 1 or 0 / 0


def _tensor_term(tensor):
    return tf.nn.l2_loss(tensor if tensor.dtype == tf.float32 else tf.cast(tensor, tf.float32))


def finite_each(tensors):
    """Per tensor, whether every element is finite: the sums first, exact if one is not."""
    totals = tf.stack([sum_term(t) for t in tensors])
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(totals)),
        lambda: tf.ones([len(tensors)], tf.bool),
        lambda: tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]),
    )


def input_values(tensors):
    """The floating inputs' dense values (a sparse or ragged tensor's stored values)."""
    values = (_dense_values(t) for t in tensors if t is not None)
    return [t for t in values if t.dtype.is_floating]


def _dense_values(tensor):
    """The stored values of a sparse or ragged tensor, or the tensor."""
    if isinstance(tensor, tf.SparseTensor):
        return tensor.values
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.flat_values
    return tf.convert_to_tensor(tensor)


def tensor_terms(tensors):
    values = (
        tf.convert_to_tensor(t.values if isinstance(t, tf.IndexedSlices) else t)
        for t in tensors
        if t is not None
    )
    return [_tensor_term(t) for t in values if t.dtype.is_floating]


def nonfinite_sum(groups, scales, dtype):
    """The sum of `scales[g]` over the groups `g` whose float32 total is non-finite.

    A group's total is non-finite when one of its terms is, or when the sum
    overflows. One `is_finite` for all groups, then a product with the scales:
    kernels the train step already runs (`add`, `stack`, `sum`, `cast`, `mul`),
    no `where` or segment reduction.
    """
    # An empty group is finite.
    totals = [total(group) if group else tf.zeros(()) for group in groups]
    finite = tf.cast(tf.math.is_finite(tf.stack(totals)), dtype)
    return sum(scales) - tf.reduce_sum(finite * tf.constant(scales, dtype))


def total(terms):
    if len(terms) <= 2:  # one add is cheaper than a stack and a sum
        return sum(terms[1:], terms[0])
    return tf.reduce_sum(tf.stack(terms))
