"""`BackupAndRestore` that is safe with several workers sharing one directory."""

import tempfile

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist import distributed


@keras.saving.register_keras_serializable(package="keras_safe_dist")
class MultiWorkerBackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras's `BackupAndRestore`, with only the chief writing the backup.

    Stock Keras 3 makes every worker write `latest.weights.h5` into the same
    `backup_dir`, so workers on one machine or a shared filesystem race on the
    file. Here only the chief writes `backup_dir`. Every other worker still
    saves (saving may read variables that synchronize across workers), into a
    temporary directory of its own that it deletes when training ends. On
    restart every worker restores from the chief's backup, so `backup_dir`
    must be readable by all workers (the same disk for local workers, a
    shared filesystem on a cluster).

    Backups are taken at epoch ends (`save_freq="epoch"`, the only value
    accepted): Keras resumes a restored run at the start of the saved epoch,
    so a backup taken mid-epoch would replay that epoch's first batches on
    weights that already saw them. At an epoch end no accumulation group is
    pending (a partial group was just applied), so a resumed run ends with the
    weights of an uninterrupted one.

    Args:
        backup_dir: directory for the backup, readable by every worker.
        delete_checkpoint: delete the backup when training ends normally.

    Example:

    ```python
    model.fit(x, y, callbacks=[MultiWorkerBackupAndRestore("/shared/backup")])
    ```
    """

    def __init__(self, backup_dir, delete_checkpoint=True, save_freq="epoch"):
        if save_freq != "epoch":
            raise ValueError(
                "MultiWorkerBackupAndRestore backs up at epoch ends only: Keras "
                "resumes a restored run at the start of the saved epoch. "
                f"Received: save_freq={save_freq!r}. Use save_freq='epoch'."
            )
        super().__init__(backup_dir, save_freq="epoch", delete_checkpoint=delete_checkpoint)
        self._chief_dir = backup_dir
        self._worker_dir = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        strategy = self.model.distribute_strategy
        if not distributed.is_chief(strategy):
            self._worker_dir = tempfile.mkdtemp(
                prefix=f"keras_safe_dist_backup_{distributed.worker_name(strategy)}_"
            )
            _compat.redirect_backup(self, self._worker_dir)

    def on_train_end(self, logs=None):
        if self._worker_dir is None:
            super().on_train_end(logs)
            return
        if tf.io.gfile.exists(self._worker_dir):
            tf.io.gfile.rmtree(self._worker_dir)
        _compat.redirect_backup(self, self._chief_dir)
        self._worker_dir = None

    def get_config(self):
        return {"backup_dir": self._chief_dir, "delete_checkpoint": self.delete_checkpoint}
