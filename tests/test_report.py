"""`keras-safe-dist report LOGDIR` and the Dashboard callback."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist import cli
from keras_safe_dist.report import read_log_dir

from conftest import SumCounter
from conftest import strategy_for

X = np.random.default_rng(1).normal(size=(20, 3)).astype("float32")
Y = X[:, :1] * 3.0


def train(log_dir, replicas=2, *layers, epochs=2):
    with strategy_for(replicas).scope():
        inputs = keras.Input((3,))
        x = inputs
        for layer in layers:
            x = layer(x)
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(x), global_clipnorm=0.5)
        model.compile(optimizer="sgd", loss="mse")
    cbs = [
        callbacks.ScopeAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.AggregationAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.TrainingModeAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.Dashboard(log_dir),
    ]
    history = model.fit(X, Y, batch_size=8, epochs=epochs, verbose=0, callbacks=cbs)
    return history.history


def run_cli(capsys, *argv):
    code = cli.main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_report_prints_findings_and_statistics_and_fails_on_errors(tmp_path, capsys):
    frozen = keras.layers.BatchNormalization(name="frozen")
    frozen.trainable = False
    history = train(str(tmp_path), 2, SumCounter(name="counter"), frozen)
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 1
    assert "Findings (1 error, 1 warning, 0 info):" in out
    assert "| aggregation | AGG003 | error | counter/count |" in out
    assert "| training_mode | MODE003 | warning | frozen |" in out
    assert "NaN onset:\nnone recorded" in out
    last_clip = history["clip_rate"][-1]
    assert f"| . | clip_rate | {last_clip:.4g} |" in out
    assert out.rstrip().endswith("1 finding(s) at or above 'error': failing.")


def test_report_passes_a_correct_run_with_backup_and_restore(tmp_path, capsys):
    log_dir = str(tmp_path / "logs")
    with strategy_for(2).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="adam", loss="mse")
    cbs = [
        callbacks.ScopeAudit(log_dir=log_dir, on_finding="raise"),
        callbacks.AggregationAudit(log_dir=log_dir, on_finding="raise"),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
    ]
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=cbs)
    code, out, _ = run_cli(capsys, log_dir)
    assert code == 0
    assert "Findings (0 error, 0 warning, 0 info):\nnone (2 audit reports read)" in out


def test_report_lists_a_finding_repeated_every_epoch_once(tmp_path, capsys):
    class KeepsVariables(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.kept = []

        def on_epoch_begin(self, epoch, logs=None):
            self.kept.append(keras.Variable(0.0, name="late_counter"))

    with strategy_for(2).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    audit = callbacks.ScopeAudit(log_dir=str(tmp_path), on_finding="ignore")
    model.fit(X, Y, batch_size=8, epochs=4, verbose=0, callbacks=[audit, KeepsVariables()])
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 1
    assert "Findings (1 error, 0 warning, 0 info):" in out
    assert out.count("| scope | SCOPE005 | error | variable 'late_counter' |") == 1


def test_report_json_and_fail_on_levels(tmp_path, capsys):
    frozen = keras.layers.BatchNormalization(name="frozen")
    frozen.trainable = False
    history = train(str(tmp_path), 1, frozen)
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["counts"] == {"error": 0, "warning": 1, "info": 0}
    assert (data["fail_on"], data["failed"], data["nan_onset"]) == ("error", False, None)
    assert sorted(a["name"] for a in data["audits"]) == ["aggregation", "scope", "training_mode"]
    (run,) = data["runs"]
    assert run["run"] == "."
    stats = run["statistics"]
    assert set(stats) == {"grad_norm", "clip_rate", "skipped_updates", "samples_per_update"}
    assert stats["grad_norm"]["last"] == pytest.approx(history["grad_norm"][-1], rel=1e-6)
    assert stats["samples_per_update"]["max"] == pytest.approx(max(history["samples_per_update"]), rel=1e-6)
    code, out, _ = run_cli(capsys, str(tmp_path), "--fail-on", "warning")
    assert code == 1
    assert "1 finding(s) at or above 'warning': failing." in out


def test_report_reads_a_nan_onset(tmp_path, capsys):
    (tmp_path / "nan_onset.json").write_text(json.dumps({
        "epoch": 1, "batch": 3, "kind": "activations", "layer": "bad_layer", "replica": 1,
        "variables": [], "history": [],
    }))
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 1
    assert "| nan onset | NAN001 | error | epoch 1, batch 3 | first non-finite activations, first in layer 'bad_layer', on replica 1. |" in out
    report = read_log_dir(str(tmp_path))
    assert [f.code for f in report.findings()] == ["NAN001"]


def test_report_reads_keras_tensorboard_epoch_logs(tmp_path, capsys):
    with strategy_for(1).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), log_update_stats=True)
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
    report = read_log_dir(str(tmp_path))
    (run,) = report.runs
    assert run.run == "train"
    assert run.values["grad_norm"] == pytest.approx(history.history["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_report_refuses_a_missing_or_empty_log_dir(tmp_path, capsys, make):
    log_dir = tmp_path / "nowhere" if make == "missing" else tmp_path
    code, out, err = run_cli(capsys, str(log_dir))
    assert code == 2 and out == ""
    if make == "missing":
        assert err == f"keras-safe-dist report: log directory not found: {log_dir}\n"
    else:
        assert err.startswith(f"keras-safe-dist report: nothing to report under {log_dir}: no audit_*.json")


def test_report_rejects_an_unknown_fail_on(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["report", ".", "--fail-on", "info"])
    assert raised.value.code == 2
    assert "argument --fail-on: invalid choice: 'info'" in capsys.readouterr().err


def test_dashboard_writes_its_layout_once_per_run_and_the_statistics(tmp_path):
    history = train(str(tmp_path), 2, epochs=3)
    events = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(tf.make_ndarray(config.tensor_proto).item())
    (category,) = layout.category
    assert category.title == "safe distributed training"
    assert [c.multiline.tag[0] for c in category.chart] == [
        "^safe_distributed/grad_norm$", "^safe_distributed/clip_rate$",
        "^safe_distributed/skipped_updates$", "^safe_distributed/samples_per_update$",
    ]
    logged = events.Tensors("safe_distributed/samples_per_update")
    assert [e.step for e in logged] == [0, 1, 2]
    assert [float(tf.make_ndarray(e.tensor_proto)) for e in logged] == pytest.approx(history["samples_per_update"])


def test_dashboard_rejects_a_bad_log_dir():
    with pytest.raises(TypeError, match=r"`log_dir` must be a path \(str or os.PathLike\). Received: log_dir=None"):
        callbacks.Dashboard(None)


def test_report_reads_the_nan_onset_detector_output(tmp_path, capsys):
    x = X.copy()
    x[5, 1] = np.nan  # second batch of 4
    with strategy_for(1).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    detector = callbacks.NaNOnsetDetector(log_dir=str(tmp_path))
    model.fit(x, Y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[detector])
    printed = capsys.readouterr().out
    assert printed.strip() == detector.report["summary"]
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    assert code == 1
    data = json.loads(out)
    assert (data["nan_onset"]["epoch"], data["nan_onset"]["batch"], data["nan_onset"]["kind"]) == (0, 1, "inputs")
    assert data["counts"]["error"] == 1
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert f"| nan onset | NAN001 | error | {detector.report['finding']['subject']} |" in out
    assert detector.report["summary"] in out
