"""One Keras loss recorded while `CompileLoss` runs: its numerator and denominator apart.

`micro_batch_loss` (`_loss.py`) swaps each compiled loss for a `RecordingLoss`,
which returns the value Keras would return and appends a `Term` per output: the
weighted sum of the loss values and what Keras divides it by (the loss elements
for `sum_over_batch_size`, the weights' total for `mean_with_sample_weight`,
nothing for `sum`).
"""

from typing import Any
from typing import NamedTuple
from typing import Optional

import keras
from keras import ops

from keras_safe_dist import _compat

__all__ = ["RecordingLoss", "Term"]

_COUNT_REDUCTIONS = ("sum_over_batch_size", "mean")


class Term(NamedTuple):
    """One output's loss, recorded: its numerator and denominator, weight and reduction."""

    numerator: Any
    denominator: Optional[Any]
    weight: float
    name: str
    reduction: str
    # True when the denominator is samples * elements_per_sample, with
    # elements_per_sample known at trace time.
    counts_samples: bool
    elements_per_sample: Optional[int]


class RecordingLoss:
    """Stands in for one Keras loss while `CompileLoss` runs.

    Returns the value Keras would return (for the per-output loss metrics) and
    records the numerator and denominator of its reduction.
    """

    def __init__(self, loss_fn, loss_weight, samples, terms):
        if not isinstance(loss_fn, keras.losses.Loss) or (
            type(loss_fn).__call__ is not keras.losses.Loss.__call__
        ):
            raise TypeError(
                "SafeDistributedModel needs each compiled loss to be a "
                "`keras.losses.Loss` (or a function or name Keras wraps in "
                f"one) that does not override `__call__`. Received: {loss_fn!r}. "
                "Implement `call(y_true, y_pred)` in a `keras.losses.Loss` "
                "subclass instead."
            )
        if loss_fn.reduction in (None, "none"):
            raise ValueError(
                "SafeDistributedModel needs losses that reduce to a scalar. "
                f"Received: loss {loss_fn.name!r} with "
                f"reduction={loss_fn.reduction!r}. Use "
                "reduction='sum_over_batch_size' (the Keras default), 'mean', "
                "'mean_with_sample_weight' or 'sum'."
            )
        self.loss_fn = loss_fn
        self.weight = 1.0 if loss_weight is None else float(loss_weight)
        self.samples = samples
        self.terms = terms

    def __call__(self, y_true, y_pred, sample_weight=None):
        fn = self.loss_fn
        in_mask = _compat.keras_mask(y_pred)
        with keras.name_scope(fn.name):
            y_pred = keras.tree.map_structure(
                lambda t: ops.convert_to_tensor(t, dtype=fn.dtype), y_pred
            )
            y_true = keras.tree.map_structure(
                lambda t: ops.convert_to_tensor(t, dtype=fn.dtype), y_true
            )
            values = fn.call(y_true, y_pred)
            mask = _merge_masks(in_mask, _compat.keras_mask(values))
            values = ops.convert_to_tensor(values, dtype=fn.dtype)
            if sample_weight is not None:
                sample_weight = ops.convert_to_tensor(sample_weight, fn.dtype)
                _check_weights_rank(fn, values, sample_weight)
            if mask is not None:
                mask = ops.convert_to_tensor(mask, dtype=fn.dtype)
            stock = _compat.reduce_weighted_values(
                values, sample_weight, mask, fn.reduction, fn.dtype
            )
            self.terms.append(self._term(values, sample_weight, mask))
        return stock

    def _term(self, values, sample_weight, mask):
        fn = self.loss_fn
        if len(values.shape) == 0:
            # The loss function already averaged over its micro-batch (Keras
            # then ignores sample weights): weight it by the sample count.
            return Term(
                ops.cast(values, self.samples.dtype) * self.samples,
                self.samples,
                self.weight,
                fn.name,
                fn.reduction,
                True,
                1,
            )
        # Keras returns an empty batch's values unreduced (shape (0,)) when
        # the shape is static, as in eager mode: the sum makes it a scalar.
        numerator = ops.cast(
            ops.sum(
                _compat.reduce_weighted_values(
                    values, sample_weight, mask, "sum", fn.dtype
                )
            ),
            self.samples.dtype,
        )
        elements = values.shape[1:]
        elements_per_sample = (
            None if any(d is None for d in elements) else _prod(elements)
        )
        counts_samples = (
            mask is None
            and elements_per_sample is not None
            and (
                fn.reduction in _COUNT_REDUCTIONS
                or (
                    fn.reduction == "mean_with_sample_weight"
                    and sample_weight is None
                )
            )
        )
        return Term(
            numerator,
            self._denominator(values, sample_weight, mask),
            self.weight,
            fn.name,
            fn.reduction,
            counts_samples,
            elements_per_sample,
        )

    def _denominator(self, values, sample_weight, mask):
        reduction = self.loss_fn.reduction
        dtype = self.samples.dtype
        if reduction == "sum":
            return None
        if reduction in _COUNT_REDUCTIONS:
            if mask is None:
                return ops.cast(ops.size(values), dtype)
            return ops.sum(ops.cast(mask, dtype))
        # mean_with_sample_weight: Keras divides by the sum of the weights it
        # multiplied the values with (mask included).
        weights = _compat.apply_mask(
            sample_weight, mask, dtype=values.dtype, reduction=reduction
        )
        if weights is None:
            return ops.cast(ops.size(values), dtype)
        _, weights = _compat.squeeze_or_expand_to_same_rank(values, weights)
        return ops.cast(ops.sum(weights), dtype)


def _check_weights_rank(fn, values, sample_weight):
    """Raises where Keras would spread the sample weights across the batch.

    Keras matches the weights to the loss's per-sample values by dropping or
    adding one trailing axis of size 1. With two or more extra axes it
    broadcasts them as they are: each sample's loss is multiplied by every
    sample's weight and the batch's loss no longer depends on how the
    samples are split (stock Keras returns the mean loss times the mean
    weight over one batch), so no split of it can match one big batch.
    """
    extra = len(sample_weight.shape) - len(values.shape)
    if extra < 2:
        return
    raise ValueError(
        f"SafeDistributedModel: sample_weight has {extra} more dimensions than the "
        f"per-sample values of loss {fn.name!r}, which Keras would broadcast across "
        "the batch: each sample's loss times every sample's weight, not a weighted "
        f"loss. Received: sample_weight of shape {tuple(sample_weight.shape)} for loss "
        f"values of shape {tuple(values.shape)}. Pass sample_weight of shape (batch,) "
        "or of the loss values' shape (one trailing axis of size 1 more is allowed)."
    )


def _merge_masks(first, second):
    if first is not None and second is not None:
        return first & second
    return first if first is not None else second


def _prod(dims):
    result = 1
    for d in dims:
        result *= int(d)
    return result
