"""Callbacks that write files: a folder they cannot write fails before training,
a failed write loses nothing, and nothing is left in the system temp folder."""

import os
import pathlib
import shutil
import tempfile
import warnings

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist.callbacks import MultiWorkerBackupAndRestore
from keras_safe_dist.callbacks import NaNOnsetDetector
from keras_safe_dist.nan import onset_report as _nan_report

from conftest import regression_data
from conftest import strategy_for


def model_and_data(replicas=1):
    x, y, _ = regression_data(32)
    with strategy_for(replicas).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    return model, x, y


def unwritable(tmp_path):
    """A folder no one can create, even root: its parent is a regular file."""
    (tmp_path / "file.txt").write_text("")
    return tmp_path / "file.txt" / "logs"


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def test_nan_detector_with_an_unwritable_log_dir_fails_before_training(tmp_path):
    model, x, y = model_and_data()
    counter = CountBatches()
    log_dir = unwritable(tmp_path)
    with pytest.raises(NotADirectoryError) as error:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[NaNOnsetDetector(log_dir=log_dir), counter])
    message = str(error.value)
    assert f"NaNOnsetDetector cannot write to `log_dir`={str(log_dir)!r}: Not a directory." in message
    assert "Pass a directory it can create and write, or log_dir=None." in message
    assert counter.batches == 0


@pytest.mark.parametrize("audit", ["ScopeAudit", "AggregationAudit", "TrainingModeAudit"])
def test_audit_with_an_unwritable_log_dir_fails_before_training(audit, tmp_path):
    model, x, y = model_and_data()
    counter = CountBatches()
    log_dir = unwritable(tmp_path)
    callback = getattr(callbacks, audit)(log_dir=log_dir)
    with pytest.raises(NotADirectoryError) as error:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[callback, counter])
    message = str(error.value)
    assert f"{audit} cannot write to `log_dir`={str(log_dir)!r}: Not a directory." in message
    assert "Pass a directory it can create and write, or log_dir=None." in message
    assert counter.batches == 0


def test_nan_report_that_cannot_be_written_is_still_kept_and_printed(replicas, tmp_path, monkeypatch, capsys):
    model, x, y = model_and_data(replicas)
    x[13, 0] = np.nan  # batch 1

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_nan_report, "write", full_disk)
    detector = NaNOnsetDetector(log_dir=tmp_path)
    with pytest.warns(UserWarning, match="could not write its report to log_dir=") as caught:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[detector])
    (ours,) = [w for w in caught if "could not write its report" in str(w.message)]
    assert "No space left on device" in str(ours.message)
    report = detector.report
    assert (report["batch"], report["kind"], report["files"]) == (1, "inputs", {})
    assert report["summary"] in capsys.readouterr().out


def test_backup_with_an_unwritable_dir_fails_before_training(tmp_path):
    model, x, y = model_and_data()
    counter = CountBatches()
    backup_dir = unwritable(tmp_path)
    with pytest.raises(OSError, match="MultiWorkerBackupAndRestore cannot write its backup to") as error:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[MultiWorkerBackupAndRestore(str(backup_dir)), counter])
    assert "Pass a `backup_dir` that every worker can create and write." in str(error.value)
    assert counter.batches == 0


def test_non_chief_backup_lives_under_the_backup_dir_and_is_removed(tmp_path, monkeypatch):
    from keras_safe_dist.scale_out import distributed

    model, x, y = model_and_data()
    seen = []

    class Look(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(sorted(os.listdir(tmp_path / "backup")))

    monkeypatch.setattr(distributed, "is_chief", lambda strategy=None: False)
    monkeypatch.setattr(distributed, "worker_name", lambda strategy=None: "worker_1")
    before = set(os.listdir(tempfile.gettempdir()))
    callback = MultiWorkerBackupAndRestore(str(tmp_path / "backup"))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback, Look()])
    assert seen == [["worker_1"], ["worker_1"]]
    assert not (tmp_path / "backup").exists()
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("keras_safe_dist_backup")]


def test_chief_removes_only_its_files_and_the_folder_once_empty(tmp_path):
    model, x, y = model_and_data()
    backup = tmp_path / "backup"
    (backup / "worker_1").mkdir(parents=True)  # another worker still removing its copy
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[MultiWorkerBackupAndRestore(str(backup))])
    assert sorted(os.listdir(backup)) == ["worker_1"]
    (backup / "worker_1").rmdir()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[MultiWorkerBackupAndRestore(str(backup))])
    assert not backup.exists()


@pytest.mark.parametrize("bad", ["a file", "below a file", "too long"])
def test_dashboard_with_a_bad_log_dir_fails_before_training_as_the_other_callbacks(tmp_path, bad):
    model, x, y = model_and_data()
    counter = CountBatches()
    if bad == "a file":
        log_dir, kind, problem = tmp_path / "file.txt", FileExistsError, "File exists"
        log_dir.write_text("")
    elif bad == "below a file":
        log_dir, kind, problem = unwritable(tmp_path), NotADirectoryError, "Not a directory"
    else:
        log_dir, kind, problem = tmp_path / ("x" * 300), OSError, "File name too long"
    with pytest.raises(kind) as error:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[callbacks.Dashboard(log_dir), counter])
    assert str(error.value) == (
        f"Dashboard cannot write to `log_dir`={str(log_dir)!r}: {problem}. "
        "Pass a directory it can create and write."
    )
    assert counter.batches == 0


def _fill(disk):
    """Fills `disk` to the last byte."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("make", [
    lambda log_dir: callbacks.Dashboard(log_dir),
    lambda log_dir: callbacks.AggregationAudit(log_dir=log_dir),
], ids=["Dashboard", "AggregationAudit"])
def test_a_full_disk_under_a_callback_names_the_callback_and_the_folder(make, tmpfs):
    disk = tmpfs("64k")
    _fill(disk)
    model, x, y = model_and_data()
    callback = make(str(disk / "logs"))
    with pytest.raises(OSError) as error:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[callback])
    message = str(error.value)
    name = type(callback).__name__
    assert message.startswith(f"[Errno 28] {name} could not write to log_dir=")
    assert str(disk / "logs") in message and "No space left on device" in message


class RemoveFolder(keras.callbacks.Callback):
    """Deletes `folder` at the end of epoch 0, and puts a file in its place if asked."""

    def __init__(self, folder, file_instead=False):
        super().__init__()
        self.folder, self.file_instead = folder, file_instead

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            shutil.rmtree(self.folder)
            if self.file_instead:
                pathlib.Path(self.folder).write_text("not a folder")


def test_a_log_dir_deleted_during_training_is_written_anew_with_one_warning(tmp_path):
    model, x, y = model_and_data()
    log_dir = tmp_path / "logs"
    with pytest.warns(UserWarning) as warned:
        model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                  callbacks=[RemoveFolder(log_dir), callbacks.Dashboard(str(log_dir))])
    messages = [str(w.message) for w in warned if "was removed during training" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith("Dashboard: the event file ")
    assert "A new event file is written there from now on" in messages[0]
    events = EventAccumulator(str(log_dir / "safe_distributed"), size_guidance={"tensors": 0})
    events.Reload()
    # The folder went before the Dashboard's epoch-0 end: every epoch's values are in the new file.
    assert [e.step for e in events.Tensors("safe_distributed/samples_per_update")] == [0, 1, 2]


def test_a_log_dir_replaced_by_a_file_during_training_raises_naming_the_callback(tmp_path):
    model, x, y = model_and_data()
    log_dir = tmp_path / "logs"
    with pytest.raises(OSError) as error, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                  callbacks=[RemoveFolder(log_dir, file_instead=True), callbacks.Dashboard(str(log_dir))])
    assert str(error.value).startswith(f"[Errno 20] Dashboard could not write to log_dir={str(log_dir)!r} (Not a directory")
