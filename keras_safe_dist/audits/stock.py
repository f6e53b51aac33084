"""Stock-model findings: what a plain `keras.Model` gets wrong on several replicas.

Each `DIST*` finding names a defect that `keras-safe-dist doctor` measures
and the model's configuration shows (its optimizer, its loss, its layers,
its strategy), the size where the configuration gives one, and the
`SafeDistributedModel` argument the setting moves to. A
`SafeDistributedModel`, or a model trained on one replica, gets none.
"""

import keras

from keras_safe_dist import _compat
from keras_safe_dist.audits.aggregation import describe_strategy
from keras_safe_dist.core import _warnings
from keras_safe_dist.core import is_safe_model
from keras_safe_dist.core._lazy import tensorflow as tf
from keras_safe_dist.findings import Finding

__all__ = ["stock_findings", "warn_no_update_statistics"]

_CLIPPING = ("global_clipnorm", "clipnorm", "clipvalue")
# Loss reductions that divide by the replica's own weight or mask total.
_LOCAL_DENOMINATOR = ("mean_with_sample_weight",)


def stock_findings(model, strategy):
    """The defects of a stock model's configuration on several replicas.

    Args:
        model: a `keras.Model`, compiled or not.
        strategy: the strategy training runs under.

    Returns:
        A list of `Finding`s (codes `DIST001` to `DIST005`); empty for a
        `SafeDistributedModel` or a strategy with one replica.

    Example:

    ```python
    findings = stock_findings(model, model.distribute_strategy)
    print([f.code for f in findings])  # ['DIST001'] for Adam(global_clipnorm=1.0)
    ```
    """
    replicas = strategy.num_replicas_in_sync
    if replicas < 2 or is_safe_model(model):
        return []
    where = describe_strategy(strategy)
    findings = []
    optimizer = getattr(model, "optimizer", None)
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if isinstance(candidate, keras.optimizers.Optimizer):
            findings += _optimizer_findings(candidate, replicas, where)
    findings += _loss_findings(model, where)
    if _multi_worker(strategy):
        findings.append(
            Finding.of(
                "DIST005",
                f"model '{model.name}'",
                f"stock keras.Model under {where}: fit() fails building the model "
                "from the first distributed batch (ValueError: Attempt to convert "
                "a value (PerReplica) with an unsupported type; measured by "
                "`keras-safe-dist doctor --only multi-worker-fit`).",
                "Train a SafeDistributedModel: "
                "`SafeDistributedModel.from_model(model)`, compiled in the scope.",
            )
        )
    return findings


def warn_no_update_statistics(model, where):
    """Warns when `model` is stock: it logs no update statistics.

    Args:
        model: the model being trained.
        where: the callback that needs them, e.g. `"Dashboard"`.
    """
    if is_safe_model(model):
        return
    _warnings.warn(
        f"{where} writes the update statistics (grad_norm, clip_rate, "
        "skipped_updates, samples_per_update) of a SafeDistributedModel; "
        f"model '{model.name}' is a {type(model).__name__}, so only the chart "
        "layout is written. Train `SafeDistributedModel.from_model(model)` "
        "to see them."
    )


def _optimizer_findings(optimizer, replicas, where):
    subject = f"optimizer '{optimizer.name}'"
    for name in _CLIPPING:
        value = getattr(optimizer, name, None)
        if value is None:
            continue
        size = (
            f"each element of the update's gradient can reach {replicas} x "
            f"{value:g} = {replicas * value:g}"
            if name == "clipvalue"
            else f"the update's gradient norm can reach {replicas} x {value:g} = "
            f"{replicas * value:g}"
        )
        yield Finding.of(
            "DIST001",
            subject,
            f"{name}={value:g} clips each replica's gradient before the "
            f"all-reduce under {where}, not the reduced gradient: {size} "
            "(`keras-safe-dist doctor --only clip-before-allreduce` measures it).",
            f"Move it to SafeDistributedModel, which clips once after the "
            f"all-reduce: `SafeDistributedModel.from_model(model, {name}={value:g})`, "
            f"compiled with the optimizer without `{name}`.",
        )
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps:
        yield Finding.of(
            "DIST002",
            subject,
            f"gradient_accumulation_steps={steps} under {where}: fit() crashes "
            "tracing the step (RuntimeError: `merge_call` called while defining "
            "a new graph or a tf.function), and on one device micro-batches of "
            "different sizes weigh the same (`keras-safe-dist doctor --only "
            "optimizer-accumulation uneven-accumulation`).",
            "Move it to SafeDistributedModel, which accumulates exactly: "
            f"`SafeDistributedModel.from_model(model, gradient_accumulation_steps={steps})`, "
            "compiled with the optimizer without it.",
        )


def _loss_findings(model, where):
    losses = [
        loss for loss in keras.tree.flatten(getattr(model, "loss", None) or [])
        if loss is not None
    ]
    if not losses:
        return []
    local = sorted(
        {
            loss.reduction for loss in losses
            if getattr(loss, "reduction", None) in _LOCAL_DENOMINATOR
        }
    )
    masking = [
        layer.name for layer in _compat.flatten_layers(model)
        if isinstance(layer, keras.layers.Masking) or getattr(layer, "mask_zero", False)
    ]
    subject = f"model '{model.name}' loss"
    if local or masking:
        cause = (
            f"reduction='{local[0]}' divides by each replica's own sample-weight total"
            if local
            else f"the mask of {', '.join(masking)} makes each replica divide by its "
            "own count of unmasked entries"
        )
        return [
            Finding.of(
                "DIST003",
                subject,
                f"{cause}, then stock Keras averages the replicas under {where}: "
                "whenever the replicas' shares hold different totals (sample "
                "weights, padding, an uneven last batch) their samples weigh "
                "differently than on one device.",
                "Train `SafeDistributedModel.from_model(model)`, which divides the "
                "summed loss numerator by the summed denominator.",
            )
        ]
    return [
        Finding.of(
            "DIST004",
            subject,
            f"stock Keras scales each replica's mean loss by 1/replicas under "
            f"{where}: a batch that splits unevenly (an epoch's last, when the "
            "samples are not a multiple of the batch size or the batch size of "
            "the replicas) weighs the samples of the emptier replicas more "
            "(`keras-safe-dist doctor --only uneven-replica-split`).",
            "Train `SafeDistributedModel.from_model(model)`, or keep every batch "
            "a multiple of the number of replicas.",
        )
    ]


def _multi_worker(strategy):
    """Whether stock Keras's fit() crashes under `strategy` (doctor: multi-worker-fit)."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
