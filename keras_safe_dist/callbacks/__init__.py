"""Callbacks for `fit()`, under `tf.distribute` (TensorFlow) or `keras.distribution` (JAX).

The audits (`AggregationAudit`, `ScopeAudit`, `TrainingModeAudit`), the
`Dashboard`, the `NaNOnsetDetector` and `MultiWorkerBackupAndRestore`; each
works on both backends and says where a check has no meaning on JAX
(`JAX001`).
"""

from keras_safe_dist.callbacks.aggregation_audit import AggregationAudit
from keras_safe_dist.callbacks.audit_callback import AuditCallback
from keras_safe_dist.callbacks.audit_callback import AuditError
from keras_safe_dist.callbacks.audit_callback import AuditWarning
from keras_safe_dist.callbacks.backup_and_restore import MultiWorkerBackupAndRestore
from keras_safe_dist.callbacks.dashboard import Dashboard
from keras_safe_dist.callbacks.scope_audit import ScopeAudit
from keras_safe_dist.callbacks.training_mode_audit import TrainingModeAudit
from keras_safe_dist.nan.callback import NaNOnsetDetector

__all__ = [
    "AggregationAudit",
    "AuditCallback",
    "AuditError",
    "AuditWarning",
    "Dashboard",
    "MultiWorkerBackupAndRestore",
    "NaNOnsetDetector",
    "ScopeAudit",
    "TrainingModeAudit",
]
