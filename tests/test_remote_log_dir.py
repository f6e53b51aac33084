"""A remote `log_dir` or `backup_dir` (`gs://...`): everything is written there, nothing locally.

TensorFlow's in-memory file system (`ram://`) stands in for a bucket: it goes
through `tf.io.gfile` as `gs://` does. Each test writes under a root of its own.
"""

import io
import json
import os
import uuid

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist import cli
from keras_safe_dist.core import _files
from keras_safe_dist.core import _validate
from keras_safe_dist.report import read_log_dir

from conftest import strategy_for

X = np.random.default_rng(3).normal(size=(16, 3)).astype("float32")
Y = X[:, :1] * 2.0


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A fresh remote folder; the working directory is an empty local one."""
    monkeypatch.chdir(tmp_path)
    return f"ram://{uuid.uuid4().hex}"


def _model(replicas):
    with strategy_for(replicas).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), global_clipnorm=0.5)
        model.compile(optimizer="sgd", loss="mse")
    return model


def _names(folder):
    return sorted(tf.io.gfile.listdir(folder))


@pytest.mark.parametrize("replicas", [1, 2], ids=["1replica", "2replicas"])
def test_the_callbacks_write_a_remote_log_dir_there_and_report_reads_it_back(
    root, tmp_path, capsys, replicas
):
    log_dir = f"{root}/logs"
    x = X.copy()
    x[5, 1] = np.nan  # the second batch of 4
    detector = callbacks.NaNOnsetDetector(log_dir=log_dir)
    cbs = [
        callbacks.ScopeAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.AggregationAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.Dashboard(log_dir),
        detector,
    ]
    _model(replicas).fit(x, Y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=cbs)
    capsys.readouterr()

    assert os.listdir(tmp_path) == []  # no local folder named `ram:`
    written = _names(log_dir)
    assert {"audit_aggregation.json", "audit_scope.json", "nan_onset.json", "nan_onset_batch.npz"} <= set(written)
    assert not [name for name in written if ".tmp" in name]
    assert detector.report["files"]["report"] == f"{log_dir}/nan_onset.json"
    with tf.io.gfile.GFile(f"{log_dir}/nan_onset_batch.npz", "rb") as f:
        batch = np.load(io.BytesIO(f.read()))
        np.testing.assert_array_equal(np.isnan(batch["x"]).sum(), 1)

    report = read_log_dir(log_dir)
    assert sorted(audit.name for audit in report.audits) == ["aggregation", "scope"]
    ((run, onset),) = report.nan_onsets
    assert (run, onset["epoch"], onset["batch"], onset["kind"]) == (".", 0, 1, "inputs")
    assert [run.run for run in report.runs] == ["safe_distributed"]
    assert report.errors == [] and report.warnings == []

    code = cli.main(["report", log_dir, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["counts"]["error"] == 1


def test_a_remote_backup_dir_holds_the_backup_and_nothing_is_written_locally(root, tmp_path):
    backup_dir = f"{root}/backup"
    backup = callbacks.MultiWorkerBackupAndRestore(backup_dir, delete_checkpoint=False)
    _model(1).fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[backup])
    assert os.listdir(tmp_path) == []
    assert _names(backup_dir) == ["epoch_2.weights.h5", "training_metadata.json"]
    with tf.io.gfile.GFile(f"{backup_dir}/training_metadata.json") as f:
        metadata = json.load(f)
    assert (metadata["epoch"], metadata["weights"]) == (2, "epoch_2.weights.h5")  # epochs done


def test_a_remote_file_is_replaced_whole_or_left_as_it_was(root):
    path = f"{root}/report.json"
    _files.makedirs(root)
    with _files.written_whole(path) as f:
        f.write("first")
    with pytest.raises(RuntimeError, match="half written"):
        with _files.written_whole(path) as f:
            f.write("sec")
            raise RuntimeError("half written")
    with tf.io.gfile.GFile(path) as f:
        assert f.read() == "first"
    assert _names(root) == ["report.json"]  # the file beside it removed
    with _files.written_whole(path, "wb") as f:
        f.write(b"second")
    with tf.io.gfile.GFile(path) as f:
        assert f.read() == "second"


def test_a_remote_log_dir_is_created_and_checked_without_leaving_a_file(root):
    log_dir = f"{root}/a/b"
    _validate.writable_directory("NaNOnsetDetector", "log_dir", log_dir)
    assert tf.io.gfile.isdir(log_dir)
    assert _names(log_dir) == []


def test_a_missing_remote_log_dir_is_named_without_the_local_working_directory(root):
    with pytest.raises(FileNotFoundError, match="log directory not found") as raised:
        read_log_dir(f"{root}/missing")
    assert f"{root}/missing" in str(raised.value)
    assert "working directory" not in str(raised.value)
    _files.makedirs(root)
    with tf.io.gfile.GFile(f"{root}/file", "w") as f:
        f.write("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        read_log_dir(f"{root}/file")


def test_a_local_file_is_replaced_whole_or_left_as_it_was_too(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("first")
    with pytest.raises(RuntimeError, match="half written"):
        with _files.written_whole(str(path)) as f:
            f.write("sec")
            raise RuntimeError("half written")
    assert path.read_text() == "first"
    assert os.listdir(tmp_path) == ["report.json"]  # the file beside it removed
