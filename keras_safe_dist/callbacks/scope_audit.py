"""`ScopeAudit`: objects and variables created outside the training strategy."""

from keras_safe_dist.audits import CreationWatch
from keras_safe_dist.audits import scope_findings
from keras_safe_dist.audits import training_strategy
from keras_safe_dist.audits.jax_backend import not_applicable
from keras_safe_dist.callbacks.audit_callback import AuditCallback
from keras_safe_dist.callbacks.audit_callback import AuditError
from keras_safe_dist.core import on_jax
from keras_safe_dist.findings import AuditReport

__all__ = ["ScopeAudit"]


class ScopeAudit(AuditCallback):
    """Audits strategy-scope placement when training begins and during fit.

    At train begin, checks that the variables of the model (`SCOPE001`), the
    optimizer (`SCOPE002`), each metric (`SCOPE003`) and the loss scale
    (`SCOPE004`) belong to the strategy `fit()` runs under; under the default
    strategy or `OneDeviceStrategy`, plain variables do. From train begin to
    train end it watches variable creation with `tf.variable_creator_scope`
    (tf.function tracing included) and flags each variable created outside
    that strategy that something still holds (`SCOPE005`), naming the code
    that created it. The report is published at train begin (TensorBoard
    step 0) and once per epoch (step `epoch + 1`), when the next epoch begins
    or training ends, so that what the callbacks after this one create in
    their `on_epoch_end` counts in that epoch. Each report holds every
    finding of the `fit()` so far, once per code and subject, and warns or
    raises only for the new ones. Put `ScopeAudit` before other callbacks so
    that their `on_train_begin` is watched too.

    On Keras's JAX backend there is no strategy scope: the report, published
    once at train begin, holds one `JAX001` finding of severity `info` (an
    info finding, not a warning, so that a script shared by both backends
    runs quietly), and nothing is watched.

    Args:
        log_dir: where to write the report; None writes nothing.
        on_finding: `"warn"`, `"raise"` or `"ignore"`; see `AuditCallback`.
        ignore: finding codes to drop.

    Raises:
        ValueError, TypeError, AuditError, OSError: as `AuditCallback`
            raises them, for `log_dir`, `on_finding` and `ignore`.

    Example:

    ```python
    audit = keras_safe_dist.callbacks.ScopeAudit(log_dir="logs", on_finding="raise")
    model.fit(x, y, callbacks=[audit, *other_callbacks])  # first in the list
    print(audit.report.summary())
    ```
    """

    name = "scope"

    def __init__(self, log_dir=None, on_finding="warn", ignore=()):
        super().__init__(log_dir=log_dir, on_finding=on_finding, ignore=ignore)
        self._watch = None
        self._placement = []
        self._epoch_done = None
        self._last_step = 0
        self._published = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._stop_watching()
        if on_jax():
            self.publish(AuditReport(self.name, [not_applicable("ScopeAudit", ("scope",))]))
            return
        strategy = training_strategy(self.model)
        self._placement = scope_findings(self.model, strategy)
        self._epoch_done = None
        self._last_step = 0
        self._published = len(self._placement)
        self.publish(AuditReport(self.name, self._placement))
        self._watch = CreationWatch(strategy)
        self._watch.start()

    def on_epoch_begin(self, epoch, logs=None):
        self._publish_epoch()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_done = epoch + 1

    def on_train_end(self, logs=None):
        try:
            self._publish_epoch(train_end=True)
        finally:
            self._stop_watching()

    def _publish_epoch(self, train_end=False):
        if self._watch is None:
            return
        step, self._epoch_done = self._epoch_done, None
        if step is None and not train_end:
            return
        findings = self._placement + self._watch.findings()
        if step is None:
            # Training ended with no epoch ended since the last report (no
            # epoch ran): report what was created since, at the next step.
            if len(findings) == self._published:
                return
            step = self._last_step + 1
        self._last_step = step
        self._published = len(findings)
        try:
            self.publish(AuditReport(self.name, findings), step=step)
        except AuditError:
            self._stop_watching()  # fit() ends here, without on_train_end
            raise

    def _stop_watching(self):
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
