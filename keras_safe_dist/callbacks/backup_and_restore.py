"""`BackupAndRestore` that is safe with several workers sharing one directory."""

import contextlib
import os
import warnings

import keras

from keras_safe_dist import _compat
from keras_safe_dist.callbacks import _backup_files
from keras_safe_dist.core import _files
from keras_safe_dist.core import _json
from keras_safe_dist.core import _lock
from keras_safe_dist.scale_out import distributed


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
    before the first epoch, not at its end, and takes the directory's lock:
    a second run on the same `backup_dir` at once is refused, naming the
    run that holds it (a crashed run's lock is taken over).

    Backups are taken at epoch ends (`save_freq="epoch"`, the only value
    accepted): Keras resumes a restored run at the start of the saved epoch,
    so a backup taken mid-epoch would replay that epoch's first batches on
    weights that already saw them. At an epoch end no accumulation group is
    pending (a partial group was just applied), so a resumed run ends with the
    weights of an uninterrupted one.

    A backup is one unit, restored whole or not at all: the weights after N
    epochs (`epoch_<N>.weights.h5`) and `training_metadata.json`, which names
    that file, its size and SHA-256 digest and N. Each is written beside its
    final name and then renamed over it, the metadata last, so a process
    killed at any moment of a backup leaves the previous backup whole. A
    backup whose weights or metadata are missing, damaged or not of this
    shape, or whose epoch is beyond `fit()`'s `epochs`, raises an error
    naming `backup_dir` and the file; delete the folder to start over.

    Args:
        backup_dir: directory for the backup, readable by every worker.
        delete_checkpoint: delete the backup when training ends normally
            (the chief's files, then `backup_dir` itself once empty).
        save_freq: `"epoch"`, the only value accepted; kept for the
            signature of Keras's `BackupAndRestore`.

    Raises:
        TypeError: for a `backup_dir` that is not a path (str or
            `os.PathLike`), or a `delete_checkpoint` that is not a bool.
        ValueError: for a `save_freq` other than `"epoch"`, or an empty
            `backup_dir` (Keras's own check); when training begins, for a
            backup that cannot be restored whole (the model is left as it
            was).
        OSError: when training begins, for a directory the worker cannot
            create or write.
        RuntimeError: when training begins, for a directory another live
            run is using (`_lock.FolderInUse`, naming its process).

    Example:

    ```python
    model.fit(x, y, callbacks=[MultiWorkerBackupAndRestore("/shared/backup")])
    ```
    """

    def __init__(self, backup_dir, delete_checkpoint=True, save_freq="epoch"):
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(
                "MultiWorkerBackupAndRestore's `backup_dir` must be a path (str or "
                f"os.PathLike) that every worker can read. Received: backup_dir={backup_dir!r}"
            )
        backup_dir = os.fspath(backup_dir)
        if not isinstance(delete_checkpoint, bool):
            raise TypeError(
                "MultiWorkerBackupAndRestore's `delete_checkpoint` must be True (delete "
                "the backup when training ends normally) or False (keep it). Received: "
                f"delete_checkpoint={delete_checkpoint!r}"
            )
        if save_freq != "epoch":
            raise ValueError(
                "MultiWorkerBackupAndRestore backs up at epoch ends only: Keras "
                "resumes a restored run at the start of the saved epoch. "
                f"Received: save_freq={save_freq!r}. Use save_freq='epoch'."
            )
        super().__init__(backup_dir, save_freq="epoch", delete_checkpoint=delete_checkpoint)
        self._chief_dir = backup_dir
        self._worker_dir = None
        self._lock = None
        self._backup_size = None  # bytes of the last weights file written

    def on_train_begin(self, logs=None):
        self._backup_size = None
        # None on JAX, where process 0 is the chief.
        strategy = distributed.strategy_of(self.model)
        chief = distributed.is_chief(strategy)
        worker_dir = None
        if chief:
            _backup_files.check_writable(self._chief_dir)
        else:
            worker_dir = os.path.join(self._chief_dir, distributed.worker_name(strategy))
            _backup_files.check_writable(worker_dir)
        # One run per folder: another run's clean-up would delete this one's
        # files (each process locks the folder it writes).
        written = worker_dir or self._chief_dir
        if not _files.remote(written):
            self._lock = _lock.acquire(written, "MultiWorkerBackupAndRestore")
        # Every worker restores from the chief's backup; reading it changes
        # nothing on disk, so the workers need not take turns.
        self._restore()
        self._worker_dir = worker_dir

    def on_epoch_end(self, epoch, logs=None):
        self._save(self._worker_dir or self._chief_dir, epoch + 1)

    def on_train_end(self, logs=None):
        # Not Keras's rmtree of the whole directory: the workers end at their
        # own pace, each removes what it wrote, then the directory if it is
        # empty (whichever removes last sees it empty).
        if self._lock is not None:
            _lock.release(self._lock)
            self._lock = None
        if self._worker_dir is not None:
            _files.remove(self._worker_dir)
            self._worker_dir = None
        elif self.delete_checkpoint:
            # The metadata first: without it the weights are no backup.
            _files.remove(os.path.join(self._chief_dir, _backup_files.METADATA_FILE))
            for name in _backup_files.own_files(self._chief_dir):
                _files.remove(os.path.join(self._chief_dir, name))
        if self.delete_checkpoint:
            _backup_files.remove_if_empty(self._chief_dir)
        # Keras keeps the restored epoch on the model, where the next fit()
        # would start from it even without a backup.
        _compat.set_initial_epoch(self.model, None)

    def get_config(self):
        return {"backup_dir": self._chief_dir, "delete_checkpoint": self.delete_checkpoint}

    def _save(self, directory, epoch):
        """Writes the weights after `epoch` epochs, then the metadata that commits them."""
        _files.makedirs(directory)
        name = _backup_files.weights_name(epoch)
        path = os.path.join(directory, name)
        tmp = os.path.join(directory, f"{_backup_files.TMP_PREFIX}{os.getpid()}_{name}")
        # HDF5 crashes the process on a full disk (a segmentation fault after
        # errno 28): make sure of the room first, the previous backup kept.
        previous = _files.exists(os.path.join(directory, _backup_files.METADATA_FILE))
        _backup_files.check_room(
            directory, name, epoch, self._backup_size or _backup_files.estimated_size(self.model), previous
        )
        try:
            self.model.save_weights(tmp, overwrite=True)
        except Exception as error:
            _files.remove(tmp)
            raise OSError(
                f"MultiWorkerBackupAndRestore could not write {name} to backup_dir="
                f"{directory!r} ({type(error).__name__}: {error}). The previous backup is kept."
            ) from error
        size, digest = _backup_files.digest(tmp)
        self._backup_size = size
        _files.rename(tmp, path)
        metadata = {
            "epoch": epoch,
            "batch": 0,
            "weights": name,
            "weights_bytes": size,
            "weights_sha256": digest,
        }
        # The commit point: until this replace, the previous metadata names
        # the previous weights file, which is still there.
        _json.write(os.path.join(directory, _backup_files.METADATA_FILE), metadata)
        for other in _backup_files.own_files(directory):
            if other != name:
                _files.remove(os.path.join(directory, other))

    def _restore(self):
        """Restores the chief's backup whole, or raises naming what is damaged."""
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, "
                "you model must be built before you call `fit()`. "
                f"Model {self.model} is unbuilt. You can build it "
                "beforehand by calling it on a batch of data."
            )
        directory = self._chief_dir
        metadata_path = os.path.join(directory, _backup_files.METADATA_FILE)
        if not _files.exists(metadata_path):
            committed = [
                n for n in _backup_files.own_files(directory)
                if not n.startswith(_backup_files.TMP_PREFIX)
            ]
            if committed:
                raise _backup_files.damaged(
                    directory, committed[0],
                    f"is there but {_backup_files.METADATA_FILE}, which says which epoch it "
                    "belongs to, is missing",
                )
            return  # no backup: training starts from the beginning
        metadata = _backup_files.read_metadata(directory, metadata_path)
        epochs = (self.params or {}).get("epochs")
        if epochs is not None and metadata["epoch"] > epochs:
            raise _backup_files.damaged(
                directory, _backup_files.METADATA_FILE,
                f"says {metadata['epoch']} epochs are done, more than this fit()'s "
                f"epochs={epochs}: it is the backup of another run",
            )
        if metadata["weights"] != _backup_files.weights_name(metadata["epoch"]):
            # Hand-edited, or put together from two backups: resuming would
            # start at one epoch with the weights of another.
            raise _backup_files.damaged(
                directory, _backup_files.METADATA_FILE,
                f"says {metadata['epoch']} epochs are done but names "
                f"{metadata['weights']}, which this callback writes after "
                f"{_backup_files.weights_epoch(metadata['weights'])} epochs: it was edited or mixed up",
            )
        weights_path = os.path.join(directory, metadata["weights"])
        if not _files.exists(weights_path):
            raise _backup_files.damaged(
                directory, metadata["weights"],
                f"is missing, although {_backup_files.METADATA_FILE} names it",
            )
        size, digest = _backup_files.digest(weights_path)
        if (size, digest) != (metadata["weights_bytes"], metadata["weights_sha256"]):
            raise _backup_files.damaged(
                directory, metadata["weights"],
                f"is damaged: {size} bytes with SHA-256 {digest[:12]}..., where "
                f"{_backup_files.METADATA_FILE} recorded {metadata['weights_bytes']} bytes with "
                f"SHA-256 {metadata['weights_sha256'][:12]}...",
            )
        self._load_whole(directory, metadata["weights"])
        _compat.set_initial_epoch(self.model, metadata["epoch"])
        if metadata["epoch"] > 0 and self.model.__dict__.get("_fit_shuffles"):
            warnings.warn(_resumed_shuffling(metadata["epoch"]), stacklevel=2)

    def _load_whole(self, directory, name):
        """Loads the weights file; on failure puts every variable back as it was."""
        model = self.model
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            # The optimizer's variables must exist before they are loaded, in
            # the strategy's scope on TensorFlow (JAX has none).
            strategy = distributed.strategy_of(model)
            with strategy.scope() if strategy is not None else contextlib.nullcontext():
                optimizer.build(model.trainable_variables)
        variables = list(model.weights) + list(optimizer.variables if optimizer is not None else [])
        before = [variable.numpy() for variable in variables]
        try:
            model.load_weights(os.path.join(directory, name))
        except Exception as error:
            for variable, value in zip(variables, before):
                variable.assign(value)
            raise _backup_files.damaged(
                directory, name,
                f"does not fit this model and optimizer ({type(error).__name__}: "
                f"{error}); the model was left as it was",
            ) from error


def _resumed_shuffling(epoch):
    return (
        f"MultiWorkerBackupAndRestore resumed after epoch {epoch} of a fit() that shuffles "
        "its arrays (shuffle=True, fit()'s default): the remaining epochs draw a new order "
        "of the samples, so the run ends near the weights of an uninterrupted run, not at "
        "them (0.041 relative on a 2-process JAX test; stock BackupAndRestore: 0.022). "
        "For an exact resume pass shuffle=False, with the data shuffled once beforehand or "
        "by a pipeline that seeds each epoch's order from the epoch."
    )
