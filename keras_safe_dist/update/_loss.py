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
from keras_safe_dist.update._recording_loss import RecordingLoss


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
            return RecordingLoss(loss_fn, loss_weight, samples, terms)

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
