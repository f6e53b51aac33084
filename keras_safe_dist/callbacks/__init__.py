"""Callbacks for `fit()` under `tf.distribute`."""

from keras_safe_dist.callbacks.backup_and_restore import MultiWorkerBackupAndRestore

__all__ = [
    "MultiWorkerBackupAndRestore",
]
