"""`TrainingModeAudit`: layers that behave differently in training did so."""

import threading

from keras_safe_dist.audits import TrainingModeSnapshot
from keras_safe_dist.audits import frozen_batch_norm_findings
from keras_safe_dist.audits.jax_backend import not_applicable
from keras_safe_dist.callbacks.audit_callback import AuditCallback
from keras_safe_dist.core import _validate
from keras_safe_dist.core import on_jax
from keras_safe_dist.findings import AuditReport

__all__ = ["TrainingModeAudit"]


class TrainingModeAudit(AuditCallback):
    """Checks after the first training steps that training mode was on.

    At train begin it flags each BatchNormalization with `trainable=False`
    in a model being trained (`MODE003`) and takes a snapshot of the state
    that only training mode changes. After `check_after_steps` batches it
    compares:

    - `MODE001`: a trainable BatchNormalization whose moving statistics did
      not move, or a Dropout / GaussianDropout / GaussianNoise /
      AlphaDropout layer whose seed did not advance: the layer ran in
      inference mode (e.g. a train step calling the model with
      `training=False`).
    - `MODE002`: a mirrored non-trainable variable whose copies differ
      across replicas.
    - `MODE004` (info): a BatchNormalization whose moving statistics differ
      across replicas (each replica updates its own copy).

    The report is published once, at that step (or at train end when fewer
    steps ran). The batch hook reads variables on that one batch only and
    returns at once on every other; it is also safe for Keras's asynchronous
    batch-callback dispatch on backends that use it.

    On Keras's JAX backend the batch hook only counts: Keras keeps the
    variables out of the model during an epoch and dispatches batch hooks on
    a thread, so the comparison is made at the end of the epoch in which
    `check_after_steps` batches ran (the state compared only moves forward,
    so the result is the same). `MODE002` and `MODE004` do not apply there
    (no per-replica copies): the report says so once, in a `JAX001` finding
    of severity `info`.

    Args:
        check_after_steps: training batches to run before comparing. Integer
            >= 1.
        log_dir: where to write the report; None writes nothing.
        on_finding: `"warn"`, `"raise"` or `"ignore"`; see `AuditCallback`.
        ignore: finding codes to drop.

    Raises:
        ValueError: when `check_after_steps` is not an integer >= 1.
        ValueError, TypeError, AuditError, OSError: as `AuditCallback`
            raises them, for `log_dir`, `on_finding` and `ignore`.

    Example:

    ```python
    audit = keras_safe_dist.callbacks.TrainingModeAudit(check_after_steps=2)
    model.fit(x, y, callbacks=[audit])
    print([f.code for f in audit.report])  # [] when training mode was on
    ```
    """

    name = "training_mode"

    def __init__(self, check_after_steps=2, log_dir=None, on_finding="warn", ignore=()):
        super().__init__(log_dir=log_dir, on_finding=on_finding, ignore=ignore)
        self.check_after_steps = _validate.integer_at_least(
            "check_after_steps", check_after_steps
        )
        # Keras dispatches batch hooks on threads on thread-safe backends (not
        # TensorFlow, where they run on the training thread).
        self.async_safe = True
        self._lock = threading.Lock()
        self._snapshot = None
        self._frozen = []
        self._steps = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._frozen = frozen_batch_norm_findings(self.model)
        self._snapshot = TrainingModeSnapshot(self.model)
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        with self._lock:
            if self._snapshot is None:
                return
            self._steps += 1
            if self._steps >= self.check_after_steps and not on_jax():
                self._check()

    def on_epoch_end(self, epoch, logs=None):
        with self._lock:
            if on_jax() and self._snapshot is not None and self._steps >= self.check_after_steps:
                self._check()

    def on_train_end(self, logs=None):
        with self._lock:
            if self._snapshot is not None:
                self._check()

    def _check(self):
        snapshot, self._snapshot = self._snapshot, None
        findings = list(self._frozen)
        if on_jax():
            self.model.jax_state_sync()  # Keras's JAX trainer: variables back on the model
            findings.append(not_applicable("TrainingModeAudit", ("replica copies",)))
        if self._steps:
            findings += snapshot.findings()
        self.publish(AuditReport(self.name, findings), step=self._steps)
