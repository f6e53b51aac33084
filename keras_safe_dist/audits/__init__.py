"""Audits of a model's distributed-training setup, as findings with stable codes."""

import keras

from keras_safe_dist.audits._creation import CreationWatch
from keras_safe_dist.audits._creation import created_at
from keras_safe_dist.audits.aggregation import aggregation_findings
from keras_safe_dist.audits.jax_backend import layout_findings
from keras_safe_dist.audits.jax_backend import not_applicable
from keras_safe_dist.audits.scope import ScopeError
from keras_safe_dist.audits.scope import check_scope
from keras_safe_dist.audits.scope import creation_site
from keras_safe_dist.audits.scope import current_scope_findings
from keras_safe_dist.audits.scope import scope_findings
from keras_safe_dist.audits.scope import training_strategy
from keras_safe_dist.audits.stock import stock_findings
from keras_safe_dist.audits.train_step import audit_train_step
from keras_safe_dist.audits.training_mode import TrainingModeSnapshot
from keras_safe_dist.audits.training_mode import frozen_batch_norm_findings
from keras_safe_dist.core import on_jax
from keras_safe_dist.core._lazy import tensorflow as tf
from keras_safe_dist.findings import AuditReport

__all__ = [
    "CreationWatch",
    "ScopeError",
    "TrainingModeSnapshot",
    "aggregation_findings",
    "audit",
    "audit_train_step",
    "check_scope",
    "created_at",
    "creation_site",
    "current_scope_findings",
    "frozen_batch_norm_findings",
    "scope_findings",
    "stock_findings",
    "training_strategy",
]


def audit(model, strategy=None):
    """Checks a built model before training, without running a step.

    Runs the static checks of every audit callback: variable aggregation
    (`AGG*`), strategy-scope placement of model, optimizer, loss scale and
    metrics (`SCOPE001`-`SCOPE004`), frozen BatchNormalization layers
    (`MODE003`) and, for a stock `keras.Model` on several replicas, the
    defects its configuration shows (`DIST*`: an optimizer that clips or
    accumulates per replica, a loss that mis-weights the replicas' shares). Checks that need training steps (`SCOPE005`, `MODE001`,
    `MODE002`, `MODE004`) run in the callbacks.

    On Keras's JAX backend the aggregation, scope and stock-model checks
    have no meaning (see `keras_safe_dist.audits.jax_backend`). The report
    holds `MODE003`, `JAX002` for variables of the model, its optimizer or
    its metrics not laid out as the `keras.distribution` distribution in
    effect says (created before `set_distribution`), and one `JAX001`
    (`info`) saying which checks ran and which do not apply.

    Args:
        model: a built `keras.Model`, compiled or not.
        strategy: the strategy training will run under; defaults to the
            strategy whose scope created the model, else the current one.

    Returns:
        An `AuditReport` named `"pre-flight"`.

    Raises:
        TypeError: when `model` is not a `keras.Model` or `strategy` not a
            `tf.distribute.Strategy`.
        ValueError: when the model has no variables yet.

    Example:

    ```python
    report = keras_safe_dist.audit(model)
    print(report.to_markdown())
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model. Received: model={model!r}"
        )
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(
            "`strategy` must be a tf.distribute.Strategy or None. "
            f"Received: strategy={strategy!r}"
        )
    if not model.variables:
        raise ValueError(
            f"audit() needs a built model, but model '{model.name}' has no "
            "variables yet. Call model.build(input_shape) or run it on one "
            "batch first."
        )
    if on_jax():
        findings = frozen_batch_norm_findings(model)
        findings += layout_findings(model)
        findings.append(not_applicable("audit()", ("aggregation", "scope", "stock model")))
        return AuditReport("pre-flight", findings)
    strategy = training_strategy(model, strategy)
    findings, _ = aggregation_findings(model, strategy)
    findings += scope_findings(model, strategy)
    findings += frozen_batch_norm_findings(model)
    findings += stock_findings(model, strategy)
    return AuditReport("pre-flight", findings)
