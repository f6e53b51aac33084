"""`BackupAndRestore` that is safe with several workers sharing one directory."""

import os

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist import distributed

# What Keras's BackupAndRestore writes into its directory.
_CHIEF_FILES = (
    "latest.weights.h5",
    "training_metadata.json",
    "latest.weights.h5.bkp",
    "training_metadata.json.bkp",
)


@keras.saving.register_keras_serializable(package="keras_safe_dist")
class MultiWorkerBackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras's `BackupAndRestore`, with only the chief writing the backup.

    Stock Keras 3 makes every worker write `latest.weights.h5` into the same
    `backup_dir`, so workers on one machine or a shared filesystem race on the
    file. Here only the chief writes the backup. Every other worker still
    saves (saving may read variables that synchronize across workers), into
    `backup_dir/<worker name>` (e.g. `worker_1`), which it deletes when
    training ends; a worker that crashed leaves it there, and the next run
    overwrites it. On restart every worker restores from the chief's backup,
    so `backup_dir` must be readable by all workers (the same disk for local
    workers, a shared filesystem on a cluster). When training begins, each
    worker checks that it can write its directory, so a wrong path fails
    before the first epoch, not at its end.

    Backups are taken at epoch ends (`save_freq="epoch"`, the only value
    accepted): Keras resumes a restored run at the start of the saved epoch,
    so a backup taken mid-epoch would replay that epoch's first batches on
    weights that already saw them. At an epoch end no accumulation group is
    pending (a partial group was just applied), so a resumed run ends with the
    weights of an uninterrupted one.

    Args:
        backup_dir: directory for the backup, readable by every worker.
        delete_checkpoint: delete the backup when training ends normally
            (the chief's files, then `backup_dir` itself once empty).
        save_freq: `"epoch"`, the only value accepted; kept for the
            signature of Keras's `BackupAndRestore`.

    Raises:
        ValueError: for a `save_freq` other than `"epoch"`, or an empty
            `backup_dir` (Keras's own check).
        OSError: when training begins, for a directory the worker cannot
            create or write.

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
        strategy = self.model.distribute_strategy
        if distributed.is_chief(strategy):
            _check_writable(self._chief_dir)
            super().on_train_begin(logs)
            return
        super().on_train_begin(logs)
        self._worker_dir = os.path.join(self._chief_dir, distributed.worker_name(strategy))
        _check_writable(self._worker_dir)
        _compat.redirect_backup(self, self._worker_dir)

    def on_train_end(self, logs=None):
        # Not Keras's rmtree of the whole directory: the workers end at their
        # own pace, each removes what it wrote, then the directory if it is
        # empty (whichever removes last sees it empty).
        if self._worker_dir is not None:
            _remove(self._worker_dir)
            _compat.redirect_backup(self, self._chief_dir)
            self._worker_dir = None
        elif self.delete_checkpoint:
            for name in _CHIEF_FILES:
                _remove(os.path.join(self._chief_dir, name))
        if self.delete_checkpoint:
            _remove_if_empty(self._chief_dir)

    def get_config(self):
        return {"backup_dir": self._chief_dir, "delete_checkpoint": self.delete_checkpoint}


def _check_writable(directory):
    """Creates `directory` if needed and writes and deletes a file in it.

    Raises:
        OSError: naming the directory, the problem and what to do.
    """
    probe = os.path.join(directory, f".keras_safe_dist_write_check_{os.getpid()}")
    try:
        tf.io.gfile.makedirs(directory)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("")
        tf.io.gfile.remove(probe)
    except (OSError, tf.errors.OpError) as error:
        problem = getattr(error, "message", None) or str(error)
        raise OSError(
            f"MultiWorkerBackupAndRestore cannot write its backup to {directory!r}: "
            f"{problem}. Pass a `backup_dir` that every worker can create and write."
        ) from error


def _remove_if_empty(directory):
    try:
        if tf.io.gfile.isdir(directory) and not tf.io.gfile.listdir(directory):
            tf.io.gfile.rmtree(directory)
    except tf.errors.NotFoundError:
        pass  # another worker removed it


def _remove(path):
    try:
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        elif tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
    except tf.errors.NotFoundError:
        pass
