"""`ScopeAudit`: objects and variables created outside the training strategy."""

from keras_safe_dist.audits import CreationWatch
from keras_safe_dist.audits import scope_findings
from keras_safe_dist.audits import training_strategy
from keras_safe_dist.callbacks.audit_callback import AuditCallback
from keras_safe_dist.findings import AuditReport

__all__ = ["ScopeAudit"]


class ScopeAudit(AuditCallback):
    """Audits strategy-scope placement when training begins and during fit.

    At train begin, checks that the variables of the model (`SCOPE001`), the
    optimizer (`SCOPE002`), each metric (`SCOPE003`) and the loss scale
    (`SCOPE004`) belong to the strategy `fit()` runs under. From train begin
    to train end it watches variable creation with
    `tf.variable_creator_scope` (tf.function tracing included) and flags each
    variable created outside that strategy (`SCOPE005`), naming the code that
    created it; such findings are reported at the end of each epoch and at
    train end. Put `ScopeAudit` before other callbacks so that their
    `on_train_begin` is watched too.

    Args:
        log_dir: where to write the report; None writes nothing.
        on_finding: `"warn"`, `"raise"` or `"ignore"`; see `AuditCallback`.
        ignore: finding codes to drop.
    """

    name = "scope"

    def __init__(self, log_dir=None, on_finding="warn", ignore=()):
        super().__init__(log_dir=log_dir, on_finding=on_finding, ignore=ignore)
        self._watch = None
        self._placement = []
        self._reported = 0
        self._epochs = 0

    def on_train_begin(self, logs=None):
        self._stop_watching()
        strategy = training_strategy(self.model)
        self._placement = scope_findings(self.model, strategy)
        self._reported = 0
        self._epochs = 0
        self.publish(AuditReport(self.name, self._placement))
        self._watch = CreationWatch(strategy)
        self._watch.start()

    def on_epoch_end(self, epoch, logs=None):
        self._epochs = epoch + 1
        self._report_creations()

    def on_train_end(self, logs=None):
        try:
            self._report_creations()
        finally:
            self._stop_watching()

    def _report_creations(self):
        if self._watch is None or len(self._watch.created) == self._reported:
            return
        self._reported = len(self._watch.created)
        findings = self._placement + self._watch.findings()
        self.publish(AuditReport(self.name, findings), step=self._epochs)

    def _stop_watching(self):
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
