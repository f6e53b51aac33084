"""Callbacks for `fit()` under `tf.distribute`."""

from keras_safe_dist.callbacks.backup_and_restore import MultiWorkerBackupAndRestore
from keras_safe_dist.callbacks.nan_onset import NaNOnsetDetector

__all__ = [
    "MultiWorkerBackupAndRestore",
    "NaNOnsetDetector",
]
