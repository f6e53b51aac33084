"""Splits a micro-batch loss into parts that add up exactly across micro-batches.

Keras reduces a loss over the batch it sees: `sum_over_batch_size` divides the
weighted sum by the number of loss elements, `mean_with_sample_weight` by the
sum of the sample weights, `sum` by nothing. A mean of per-micro-batch means is
not the mean of the big batch, so `SafeDistributedModel` keeps the numerator
and the denominator apart: it accumulates both over micro-batches and
replicas, and divides once per optimizer update.
"""

from typing import Any
from typing import NamedTuple
from typing import Optional

import keras
from keras import ops

from keras_safe_dist import _compat

_COUNT_REDUCTIONS = ("sum_over_batch_size", "mean")


class MicroBatchLoss(NamedTuple):
    """The additive parts of one replica's loss on one micro-batch.

    All three are scalars of one dtype, `totals_dtype(model)`.

    Attributes:
        numerator: sum of the weighted loss values (`loss_weights` applied),
            plus `add_loss`/activity losses weighted by `denominator`.
        denominator: what the group's summed numerator is divided by, or None
            when every loss uses `reduction="sum"`.
        samples: number of samples in the micro-batch on this replica.
        per_sample: True when `denominator` is the sample count times a
            constant, so that a loss weighted by its denominator is weighted
            by its samples, as Keras weights the loss it logs.
        undivided: None, or activity penalties that are added to the loss
            after the division by the denominator: keras < 3.14 adds a
            layer's activity penalty summed over its batch, not divided by it.
    """

    numerator: Any
    denominator: Optional[Any]
    samples: Any
    per_sample: bool = True
    undivided: Optional[Any] = None


def totals_dtype(model):
    """The dtype of the loss totals and statistics: float64 for a float64 model.

    float32 otherwise, also for float16 and bfloat16 models, whose sums over
    a batch would overflow or round away.
    """
    wide = keras.config.floatx() == "float64" or any(
        keras.backend.standardize_dtype(v.dtype) == "float64"
        for v in model.trainable_weights
    )
    return "float64" if wide else "float32"


def accumulator_dtype(dtype, chosen=None):
    """The dtype a weight of `dtype`'s accumulated gradients are summed in.

    Args:
        dtype: the weight's dtype.
        chosen: the model's `accumulation_dtype` (None: the default rule).

    Returns:
        `chosen` for a floating weight, when given; else float32 for a
        float16 or bfloat16 weight (sums of its gradients would round away),
        and `dtype` otherwise.
    """
    dtype = keras.backend.standardize_dtype(dtype)
    if chosen is not None and keras.backend.is_float_dtype(dtype):
        return chosen
    return "float32" if dtype in ("float16", "bfloat16") else dtype


class _Term(NamedTuple):
    numerator: Any
    denominator: Optional[Any]
    weight: float
    name: str
    reduction: str
    # True when the denominator is samples * elements_per_sample, with
    # elements_per_sample known at trace time.
    counts_samples: bool
    elements_per_sample: Optional[int]


def micro_batch_loss(model, y, y_pred, sample_weight):
    """Computes `MicroBatchLoss` with the model's compiled loss.

    The compiled loss still runs as Keras runs it, so per-output loss metrics
    are updated as in stock `fit()`, each weighted by the micro-batch's
    samples on this replica (Keras weighs it by the output's static batch
    size, unknown in TensorFlow's traced step: there each batch's value, and
    each replica's, counted 1, also an empty share's 0). For a loss whose
    denominator counts samples, an output's epoch value is then its loss over
    the epoch's samples, as stock Keras on one device computes it in one batch.
    """
    dtype = totals_dtype(model)
    samples = ops.cast(ops.shape(keras.tree.flatten(y_pred)[0])[0], dtype)
    terms = []
    compiled = _compat.compile_loss(model)
    if compiled is not None:

        def wrap(index, loss_fn, loss_weight):
            return _RecordingLoss(loss_fn, loss_weight, samples, terms)

        with _compat.swapped_loss_functions(compiled, wrap), _compat.per_output_loss_weight(
            compiled, samples
        ):
            compiled(y, y_pred, sample_weight)
    summed = [] if _compat.activity_penalty_per_sample() else _compat.activity_losses(model)
    extra = additional_losses(model, excluded=summed)
    undivided = _total(summed, dtype)
    if not terms and extra is None and undivided is None:
        raise ValueError(
            "No loss to compute. Provide a `loss` argument in `compile()` or "
            "call `add_loss()` in the model."
        )
    numerator, denominator, per_sample = _combine(terms, samples)
    if denominator is None and undivided is not None:
        extra = undivided if extra is None else extra + undivided
        undivided = None
    if extra is not None:
        if denominator is None:
            numerator = numerator + extra
        else:
            numerator = numerator + extra * denominator
    return MicroBatchLoss(numerator, denominator, samples, per_sample, undivided)


def custom_loss(value, y_pred, accumulate):
    """`MicroBatchLoss` from the value of an overridden `compute_loss()`.

    Without accumulation the value is what the replica differentiates, as in
    stock Keras (the replicas' gradients are summed). With accumulation the
    value, with Keras's `1 / replicas` scaling undone, is taken as the mean
    loss of the replica's micro-batch and weighted by its sample count.
    """
    dtype = "float64" if keras.backend.standardize_dtype(value.dtype) == "float64" else "float32"
    samples = ops.cast(ops.shape(keras.tree.flatten(y_pred)[0])[0], dtype)
    value = ops.cast(value, dtype)
    if not accumulate:
        return MicroBatchLoss(value, None, samples)
    return MicroBatchLoss(_compat.unscale_loss(value) * samples, samples, samples)


def kept(micro, keep):
    """`micro` multiplied by `keep` (1.0, or 0.0 for an empty share), or as is for None."""
    if keep is None:
        return micro
    keep = ops.cast(keep, micro.numerator.dtype)
    return micro._replace(
        numerator=micro.numerator * keep,
        denominator=None if micro.denominator is None else micro.denominator * keep,
        samples=micro.samples * keep,
        undivided=None if micro.undivided is None else micro.undivided * keep,
    )


def weight_regularization(model):
    """Sum of the weight regularization penalties, or None if there are none."""
    dtype = totals_dtype(model)
    penalties = [
        ops.cast(ops.sum(v.regularizer(v)), dtype)
        for v in model.trainable_weights
        if getattr(v, "regularizer", None) is not None
    ]
    return ops.sum(ops.stack(penalties)) if penalties else None


def additional_losses(model, excluded=()):
    """Sum of `add_loss()` and activity-regularization losses, or None.

    `model.losses` lists these first and the weight regularization penalties
    last; the penalties are applied once per update instead. Losses in
    `excluded` (the same tensors) are left out.
    """
    losses = model.losses
    regularized = sum(
        1
        for v in model.trainable_weights
        if getattr(v, "regularizer", None) is not None
    )
    left_out = {id(x) for x in excluded}
    return _total(
        [x for x in losses[: len(losses) - regularized] if id(x) not in left_out],
        totals_dtype(model),
    )


def _total(losses, dtype):
    if not losses:
        return None
    return ops.sum(ops.stack([ops.cast(ops.sum(x), dtype) for x in losses]))


def _combine(terms, samples):
    """`(numerator, denominator, per_sample)` of the terms' weighted sum."""
    if not terms:
        return ops.zeros((), samples.dtype), samples, True
    if len(terms) == 1:
        term = terms[0]
        return term.numerator * term.weight, term.denominator, term.counts_samples
    if all(t.denominator is None for t in terms):
        return sum(t.numerator * t.weight for t in terms), None, False
    if all(t.counts_samples for t in terms):
        numerator = sum(
            t.numerator * (t.weight / t.elements_per_sample) for t in terms
        )
        return numerator, samples, True
    described = ", ".join(
        f"{t.name} (reduction={t.reduction!r}, counts samples: "
        f"{t.counts_samples})"
        for t in terms
    )
    raise ValueError(
        "SafeDistributedModel cannot accumulate this multi-output loss "
        "exactly: with several outputs, every loss must use "
        "reduction='sum_over_batch_size' without a mask, or every loss must "
        f"use reduction='sum'. Received: {described}. Use one of those "
        "reductions, or combine the outputs into a single loss."
    )


class _RecordingLoss:
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
            return _Term(
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
        return _Term(
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


def summed_activity_penalties_error(model, option, value):
    """The `ValueError` for activity regularizers that keras < 3.14 sums over the batch."""
    layers = [
        layer.name
        for layer in _compat.flatten_layers(model)
        if getattr(layer, "activity_regularizer", None) is not None
    ]
    return ValueError(
        "SafeDistributedModel cannot train activity regularizers exactly with "
        f"{option}={value!r} on keras {keras.__version__}: before keras 3.14 "
        "Keras adds an activity penalty summed over the batch, not divided by "
        "it, and that sum cannot be split into micro-batches or compiled "
        "shares whose loss is divided once after the all-reduce. Received: "
        f"{option}={value!r} and activity regularizers on layers {layers}. "
        f"Use keras >= 3.14, or {option}="
        f"{1 if option == 'gradient_accumulation_steps' else False}."
    )
