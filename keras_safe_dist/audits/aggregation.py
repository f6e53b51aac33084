"""Aggregation findings: variables whose cross-replica updates are combined wrongly."""


from keras_safe_dist.audits import _variables
from keras_safe_dist.audits._tensorflow import compat as _tf_compat
from keras_safe_dist.core._lazy import tensorflow as tf
from keras_safe_dist.findings import Finding

__all__ = ["aggregation_findings", "describe_strategy"]

_ON_WRITE = ("auto", "on_write")


def aggregation_findings(model, strategy=None):
    """Checks how every variable of model, optimizer and metrics is aggregated.

    Args:
        model: a `keras.Model`.
        strategy: the strategy training runs under; defaults to
            `model.distribute_strategy`.

    Returns:
        `(findings, variables)`: the `Finding`s (codes `AGG001` to `AGG006`)
        and the `VariableInfo` of every variable inspected.

    Example:

    ```python
    findings, variables = aggregation_findings(model)
    for info in variables:
        print(info.path, info.aggregation, info.container)
    print([f.code for f in findings])
    ```
    """
    strategy = strategy or model.distribute_strategy
    distributed = _variables.distributes_variables(strategy)
    rows = [info for _, info in _variables.inventory(model)]
    findings = []
    for info in rows:
        findings.extend(_check(info, strategy, distributed))
    return findings, rows


def describe_strategy(strategy):
    """`"MirroredStrategy with 2 replicas"`, or `"no strategy (one device)"`."""
    if strategy is _tf_compat.default_strategy():
        return "no strategy (one device)"
    replicas = strategy.num_replicas_in_sync
    return (
        f"{type(strategy).__name__} with {replicas} "
        f"replica{'' if replicas == 1 else 's'}"
    )


def _check(info, strategy, distributed):
    path, aggregation = info.path, info.aggregation
    tf_name = f"tf.VariableAggregation.{info.tf_aggregation}"
    if info.role == "trainable" and aggregation != "none":
        yield Finding.of(
            "AGG001",
            path,
            f"trainable variable with aggregation='{aggregation}' ({tf_name}): "
            "the optimizer already all-reduces its gradient, so its update is "
            "reduced a second time by the variable.",
            "Create it with aggregation='none' (the default of add_weight).",
        )
    elif info.role == "optimizer-slot" and aggregation != "none":
        yield Finding.of(
            "AGG002",
            path,
            f"optimizer slot of {info.owner} with aggregation='{aggregation}' "
            f"({tf_name}): slots are updated from already-reduced gradients, "
            "so aggregating them again rescales the moment estimates.",
            "Create optimizer slots with add_variable_from_reference() or "
            "aggregation='none'.",
        )
    elif info.synchronization in _ON_WRITE and aggregation == "sum":
        yield Finding.of(
            "AGG003",
            path,
            f"on-write variable (synchronization='{info.synchronization}') "
            "with aggregation='sum': an assign in replica context sums the "
            "replicas' new values, not their changes, so assign_add(1.0) once "
            "per step on 2 replicas reads 2, 6, 14, 30.",
            "Use synchronization='on_read' for a per-replica accumulator, or "
            "aggregation='only_first_replica' for a value every replica "
            "computes alike.",
        )
    if info.role == "metric" and info.synchronization != "on_read":
        yield Finding.of(
            "AGG004",
            path,
            f"state of {info.owner} with synchronization="
            f"'{info.synchronization}' ({info.container} container): metric "
            "accumulators must be replica-local so each replica adds its own "
            "batches and a read sums them.",
            "Create metric state with Metric.add_variable() (on-read, sum).",
        )
    if distributed and info.container == "plain":
        yield Finding.of(
            "AGG005",
            path,
            f"plain variable on {', '.join(info.devices) or 'one device'} "
            f"while {info.owner} trains under {describe_strategy(strategy)}: "
            "it is not mirrored, so replicas do not share one value.",
            "Create it inside `with strategy.scope():` (the SCOPE findings "
            "name the line to move).",
        )
    if tf.as_dtype(info.dtype).is_integer and aggregation == "mean":
        yield Finding.of(
            "AGG006",
            path,
            f"integer variable ({info.dtype}) with aggregation='mean': "
            "TensorFlow refuses to create it under a distribution strategy "
            "('aggregation=MEAN and a non-floating dtype is not supported'), "
            "so this model cannot be trained on several replicas.",
            "Use aggregation='only_first_replica' for a counter every replica "
            "advances alike, or synchronization='on_read' with 'sum'.",
        )
