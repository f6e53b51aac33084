"""`AggregationAudit`: how every variable is aggregated across replicas."""

from keras_safe_dist.audits import aggregation_findings
from keras_safe_dist.audits import stock_findings
from keras_safe_dist.audits import training_strategy
from keras_safe_dist.audits._variables import all_variables
from keras_safe_dist.audits.jax_backend import not_applicable
from keras_safe_dist.callbacks.audit_callback import AuditCallback
from keras_safe_dist.core import on_jax
from keras_safe_dist.findings import AuditReport

__all__ = ["AggregationAudit"]


class AggregationAudit(AuditCallback):
    """Audits the aggregation of every variable when training begins.

    Inspects each variable of the model, the optimizer (slots, iteration
    counters, loss scale) and the metrics: its path, owner, Keras aggregation
    and synchronization, the `tf.VariableAggregation` it maps to, its
    container (`mirrored`, `on-read` or `plain`) and devices, all kept in
    `.variables` and written to `audit_aggregation.json`. Variables created
    by the first train step (metrics and layers Keras builds lazily, as it
    does without a strategy) are audited at the end of the first epoch, when
    the report is published again. Flags:

    - `AGG001`: a trainable variable whose aggregation is not `none`.
    - `AGG002`: an optimizer slot whose aggregation is not `none`.
    - `AGG003`: an on-write variable with `sum` aggregation.
    - `AGG004`: metric state that is not replica-local (on-read).
    - `AGG005`: a plain variable in a model trained under a strategy that
      mirrors variables (not the default strategy or `OneDeviceStrategy`).
    - `AGG006`: an integer variable with `mean` aggregation.

    On a stock `keras.Model` trained on several replicas it also reports how
    the replicas' gradients are combined wrongly (`DIST001` per-replica
    clipping, `DIST002` optimizer accumulation, `DIST003` and `DIST004` loss
    weighting, `DIST005` multi-worker fit); see `audits.stock_findings`.

    On Keras's JAX backend variables are not aggregated across replicas:
    the report, published once at train begin, holds one `JAX001` finding of
    severity `info` and `.variables` stays empty.

    Args:
        log_dir: where to write the report; None writes nothing.
        on_finding: `"warn"`, `"raise"` or `"ignore"`; see `AuditCallback`.
        ignore: finding codes to drop.

    Raises:
        ValueError, TypeError, AuditError, OSError: as `AuditCallback`
            raises them, for `log_dir`, `on_finding` and `ignore`.

    Example:

    ```python
    audit = keras_safe_dist.callbacks.AggregationAudit(log_dir="logs")
    model.fit(x, y, callbacks=[audit])
    print(audit.report.to_markdown())
    ```
    """

    name = "aggregation"

    def __init__(self, log_dir=None, on_finding="warn", ignore=()):
        super().__init__(log_dir=log_dir, on_finding=on_finding, ignore=ignore)
        self.variables = []

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._audit(step=0)

    def on_epoch_end(self, epoch, logs=None):
        if on_jax():
            return
        if epoch == 0 and len(all_variables(self.model)) != len(self.variables):
            self._audit(step=1)

    def _audit(self, step):
        if on_jax():
            self.variables = []
            finding = not_applicable("AggregationAudit", ("aggregation", "stock model"))
            self.publish(AuditReport(self.name, [finding]), step=step, extra={"variables": []})
            return
        strategy = training_strategy(self.model)
        findings, self.variables = aggregation_findings(self.model, strategy)
        findings += stock_findings(self.model, strategy)
        self.publish(
            AuditReport(self.name, findings),
            step=step,
            extra={"variables": [v.to_dict() for v in self.variables]},
        )

