"""`keras-safe-dist report LOGDIR` and the Dashboard callback."""

import json
import math
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist import cli
from keras_safe_dist.report import LogDirReport
from keras_safe_dist.report import format_text
from keras_safe_dist.report import read_log_dir
from keras_safe_dist.report import writer as summaries

from conftest import SumCounter
from conftest import strategy_for
from conftest import strict_json

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
    assert f"| safe_distributed | clip_rate | {last_clip:.4g} |" in out
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
    assert (data["fail_on"], data["failed"], data["nan_onsets"]) == ("error", False, [])
    assert sorted(a["name"] for a in data["audits"]) == ["aggregation", "scope", "training_mode"]
    (run,) = data["runs"]
    assert run["run"] == "safe_distributed"
    stats = run["statistics"]
    assert set(stats) == {
        "grad_norm", "clip_rate", "skipped_updates", "samples_per_update",
        "grad_norm_min", "grad_norm_mean", "grad_norm_max",
        "samples_per_update_min", "samples_per_update_mean", "samples_per_update_max",
    }
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
        assert err == (
            f"keras-safe-dist report: log directory not found: {str(log_dir)!r}. Pass the log_dir "
            "given to the callbacks (NaNOnsetDetector, the audits, Dashboard), as it is seen "
            f"from here (the working directory is {os.getcwd()})\n"
        )
    else:
        assert err.startswith(f"keras-safe-dist report: nothing to report under {log_dir}: no audit_*.json")


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_report_json_on_nothing_to_read_prints_a_document_with_the_reason(tmp_path, capsys, make):
    log_dir = tmp_path / "nowhere" if make == "missing" else tmp_path
    code, out, err = run_cli(capsys, str(log_dir), "--json")
    assert code == 2
    document = strict_json(out)
    assert document == {"log_dir": str(log_dir), "error": err[len("keras-safe-dist report: "):].rstrip("\n"), "failed": None}
    assert document["error"].startswith("log directory not found" if make == "missing" else "nothing to report under")


def test_report_rejects_an_unknown_fail_on(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["report", ".", "--fail-on", "info"])
    assert raised.value.code == 2
    assert "argument --fail-on: invalid choice: 'info'" in capsys.readouterr().err


def test_dashboard_writes_its_layout_once_per_run_and_the_statistics(tmp_path):
    history = train(str(tmp_path), 2, epochs=3)
    # A named run, not the log directory's root (where the audits write).
    root = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    root.Reload()
    assert not [tag for tag in root.Tags()["tensors"] if tag.startswith("safe_distributed/")]
    assert "custom_scalars__config__" not in root.Tags()["tensors"]
    events = event_accumulator.EventAccumulator(str(tmp_path / "safe_distributed"), size_guidance={"tensors": 0})
    events.Reload()
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(tf.make_ndarray(config.tensor_proto).item())
    category, updates = layout.category
    assert category.title == "safe distributed training"
    assert updates.title == "safe distributed training, per update"
    assert [list(c.multiline.tag) for c in updates.chart] == [
        ["^safe_distributed/update/grad_norm$"], ["^safe_distributed/update/clip_rate$"],
        ["^safe_distributed/update/skipped_updates$"], ["^safe_distributed/update/samples_per_update$"],
    ]
    assert [c.multiline.tag[0] for c in category.chart] == [
        "^safe_distributed/grad_norm(_min|_mean|_max)?$", "^safe_distributed/clip_rate$",
        "^safe_distributed/skipped_updates$", "^safe_distributed/samples_per_update(_min|_mean|_max)?$",
    ]
    logged = events.Tensors("safe_distributed/samples_per_update")
    assert [e.step for e in logged] == [0, 1, 2]
    assert [float(tf.make_ndarray(e.tensor_proto)) for e in logged] == pytest.approx(history["samples_per_update"])


def test_dashboard_rejects_a_bad_log_dir():
    with pytest.raises(TypeError, match=r"`log_dir` must be a path \(str or os.PathLike\). Received: log_dir=None"):
        callbacks.Dashboard(None)
    with pytest.raises(ValueError, match=r"`run` must be a folder name, without separators. Received: run='a/b'"):
        callbacks.Dashboard("logs", run="a/b")


def test_report_lists_each_statistic_once_beside_keras_tensorboard(tmp_path, capsys):
    with strategy_for(1).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    log_dir = str(tmp_path)
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[
        callbacks.Dashboard(log_dir), keras.callbacks.TensorBoard(log_dir),
    ])
    data = json.loads(run_cli(capsys, log_dir, "--json")[1])
    assert [run["run"] for run in data["runs"]] == ["safe_distributed"]
    assert data["runs"][0]["statistics"]["skipped_updates"] == {"last": 0.0, "max": 0.0, "mean": 0.0}
    out = run_cli(capsys, log_dir)[1]
    assert "| safe_distributed | skipped_updates | 0 | 0 | 0 |" in out
    assert out.count("| samples_per_update |") == 1


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
    (onset,) = data["nan_onsets"]
    assert (onset["run"], onset["epoch"], onset["batch"], onset["kind"]) == (".", 0, 1, "inputs")
    assert data["counts"]["error"] == 1
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert f"| nan onset | NAN001 | error | {detector.report['finding']['subject']} |" in out
    assert detector.report["summary"] in out


def _onset(epoch, batch):
    return {"epoch": epoch, "batch": batch, "kind": "inputs", "layer": None, "replica": 0, "variables": [], "history": []}


def _write_scalars(folder, tag, values):
    with tf.summary.create_file_writer(str(folder)).as_default() as writer:
        for step, value in enumerate(values):
            tf.summary.scalar(tag, value, step=step)
    writer.flush()
    writer.close()
    (path,) = folder.glob("*.tfevents.*")
    return path


def test_unreadable_reports_exit_2_naming_each_file_and_keep_the_rest(tmp_path, capsys):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "nan_onset.json").write_text('{"epoch": 1, "bat')  # truncated
    (tmp_path / "audit_scope.json").write_bytes(b"\x00\xff\x10binary")
    (tmp_path / "audit_mode.json").write_text("[1, 2]")  # JSON, not an audit report
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "nan_onset.json").write_text(json.dumps(_onset(0, 4)))
    code, out, err = run_cli(capsys, str(tmp_path))
    assert code == 2
    assert "epoch 0, batch 4" in out  # the readable onset is still reported
    problems = [line for line in err.splitlines() if "cannot read" in line]
    assert len(problems) == 3
    assert f"cannot read {tmp_path / 'run1' / 'nan_onset.json'}: not readable as JSON" in err
    assert f"cannot read {tmp_path / 'audit_scope.json'}: not readable as JSON" in err
    assert f"cannot read {tmp_path / 'audit_mode.json'}: JSON not of the shape keras_safe_dist writes" in err
    assert "the findings above leave out 3 unreadable report(s), so the exit status is 2" in err
    assert "move it aside and rerun what wrote it" in err
    data = json.loads(run_cli(capsys, str(tmp_path), "--json")[1])
    assert sorted(e["path"] for e in data["errors"]) == sorted(
        str(p) for p in (tmp_path / "run1" / "nan_onset.json", tmp_path / "audit_scope.json", tmp_path / "audit_mode.json")
    )


def test_every_runs_nan_onset_is_reported(tmp_path, capsys):
    for run, batch in (("first", 2), ("second", 7)):
        (tmp_path / run).mkdir()
        (tmp_path / run / "nan_onset.json").write_text(json.dumps(_onset(0, batch)))
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 1
    assert "| nan onset (first) | NAN001 | error | epoch 0, batch 2 |" in out
    assert "| nan onset (second) | NAN001 | error | epoch 0, batch 7 |" in out
    data = json.loads(run_cli(capsys, str(tmp_path), "--json")[1])
    assert [(o["run"], o["batch"]) for o in data["nan_onsets"]] == [("first", 2), ("second", 7)]
    assert data["counts"]["error"] == 2


def test_labelled_findings_name_each_findings_audit_or_onset_in_the_order_of_findings(tmp_path):
    from keras_safe_dist.findings import AuditReport
    from keras_safe_dist.findings import Finding

    jax_note = Finding.of("JAX001", "scope checks", "The scope checks have no meaning on JAX.", "Nothing to do.")
    audits = {
        "aggregation": [Finding.of("AGG003", "counter/count", "summed on every replica.", "Use MEAN."), jax_note],
        "training_mode": [Finding.of("JAX001", "mode checks", "The mode checks ran.", "Nothing to do.")],
    }
    for name, findings in audits.items():
        (tmp_path / f"audit_{name}.json").write_text(json.dumps(AuditReport(name, findings).to_dict()))
    (tmp_path / "nan_onset.json").write_text(json.dumps(_onset(1, 3)))
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "nan_onset.json").write_text(json.dumps(_onset(0, 5)))
    report = read_log_dir(tmp_path)
    labelled = report.labelled_findings()
    assert [(label, f.code, f.subject) for label, f in labelled] == [
        ("aggregation", "AGG003", "counter/count"),
        ("aggregation, training_mode", "JAX001", "the audits on JAX"),  # one row for both audits
        ("nan onset", "NAN001", "epoch 1, batch 3"),
        ("nan onset (second)", "NAN001", "epoch 0, batch 5"),
    ]
    assert [f for _, f in labelled] == report.findings()
    assert "| aggregation, training_mode | JAX001 | info | the audits on JAX |" in format_text(report)


def test_a_damaged_event_file_is_skipped_with_a_warning_and_earlier_values_kept(tmp_path, capsys):
    path = _write_scalars(tmp_path, "safe_distributed/skipped_updates", [0.0, 0.0, 3.0])
    intact = path.read_bytes()
    path.write_bytes(intact[:-7])  # the last record cut short
    code, out, err = run_cli(capsys, str(tmp_path))
    assert code == 0
    assert "| . | skipped_updates | 0 | 0 | 0 |" in out  # counts print as integers
    assert f"skipped {path}: event file damaged, read up to it:" in err and "truncated" in err
    assert err.count("If its run is still writing, run report again when it ends") == 1
    assert "Skipped:" in out
    path.write_bytes(intact)
    code, out, err = run_cli(capsys, str(tmp_path))
    assert "| . | skipped_updates | 3 | 3 | 1 |" in out and err == ""


def test_report_on_a_file_says_it_wants_the_log_directory(tmp_path, capsys):
    (tmp_path / "nan_onset.json").write_text(json.dumps(_onset(0, 1)))
    code, _, err = run_cli(capsys, str(tmp_path / "nan_onset.json"))
    assert code == 2
    assert f"{tmp_path / 'nan_onset.json'} is a file; report reads the log directory" in err


def test_report_reads_logs_without_loading_tensorflow(tmp_path):
    _write_scalars(tmp_path, "safe_distributed/grad_norm", [1.5])
    code = (
        "import sys\n"
        f"sys.argv = ['keras-safe-dist', 'report', {str(tmp_path)!r}]\n"
        "from keras_safe_dist.cli import main\n"
        "status = main()\n"
        f"missing = main(['report', {str(tmp_path / 'missing')!r}])\n"
        "print(status, missing, 'tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "| . | grad_norm | 1.5 | 1.5 | 1.5 |" in done.stdout
    assert done.stdout.splitlines()[-1].split() == ["0", "2", "False", "False"]
    assert f"log directory not found: {str(tmp_path / 'missing')!r}" in done.stderr


def test_an_unknown_fail_on_in_the_api_names_the_argument(tmp_path):
    report = LogDirReport(str(tmp_path), [], [], [], [], [])
    assert report.failing("info") == []
    with pytest.raises(ValueError, match=r"`fail_on` must be one of 'error', 'warning', 'info'. Received: fail_on='fatal'"):
        report.failing("fatal")
    with pytest.raises(ValueError, match=r"Received: fail_on='fatal'"):
        format_text(report, fail_on="fatal")


def test_report_into_a_closed_pipe_stops_quietly_with_sigpipe_status(tmp_path):
    # `keras-safe-dist report LOGDIR --json | head -c 1`: the reader is gone before the output.
    _write_scalars(tmp_path, "safe_distributed/grad_norm", [1.5])
    code = (
        "import sys\n"
        f"sys.argv = ['keras-safe-dist', 'report', {str(tmp_path)!r}, '--json']\n"
        "from keras_safe_dist.cli import main\n"
        "sys.exit(main())\n"
    )
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr
    assert done.returncode == 128 + signal.SIGPIPE


def test_report_json_and_nan_onset_json_are_strict_json_after_a_nan(tmp_path, capsys):
    x = X.copy()
    x[5, 1] = np.nan  # second batch of 4: its loss and gradient norm are NaN
    with strategy_for(1).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    detector = callbacks.NaNOnsetDetector(log_dir=str(tmp_path), action="continue")
    model.fit(x, Y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[detector, callbacks.Dashboard(str(tmp_path))])
    capsys.readouterr()
    onset = strict_json((tmp_path / "nan_onset.json").read_text())
    assert math.isnan(detector.report["history"][-1]["loss"])
    assert onset["history"][-1]["loss"] == "NaN"
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    assert code == 1
    data = strict_json(out)
    assert data["nan_onsets"][0]["history"][-1]["loss"] == "NaN"


def test_report_table_escapes_cells_as_the_audit_markdown_does(tmp_path, capsys):
    from keras_safe_dist.findings import AuditReport
    from keras_safe_dist.findings import Finding

    finding = Finding.of("AGG003", "model/a|b", "one | two\nthree", "fix | it")
    report = AuditReport("custom", [finding])
    (tmp_path / "audit_custom.json").write_text(json.dumps(report.to_dict()))
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 1
    (row,) = [line for line in out.splitlines() if "AGG003 | error" in line]
    assert row == "| custom | AGG003 | error | model/a\\|b | one \\| two three | fix \\| it |"
    assert row.endswith(report.to_markdown().splitlines()[-1][len("| AGG003 | error "):])


def test_report_names_the_only_event_file_when_it_is_damaged(tmp_path, capsys):
    path = _write_scalars(tmp_path, "safe_distributed/grad_norm", [1.0, 2.0])
    intact = path.read_bytes()
    for damage in (intact[:20], bytes(b ^ 0x5A for b in intact), b"garbage" * 10):
        path.write_bytes(damage)
        code, out, err = run_cli(capsys, str(tmp_path))
        assert code == 2 and out == ""
        assert err.startswith(f"keras-safe-dist report: nothing readable under {tmp_path}: ")
        assert f"the damaged event files: {path} (event file damaged, read up to it:" in err
        assert "Pass the log_dir" not in err


def test_report_skips_a_fifo_named_like_its_files_instead_of_waiting(tmp_path):
    for name in ("nan_onset.json", "events.out.tfevents.1.host"):
        os.mkfifo(tmp_path / name)
    # In a child process: a hang fails the test after the timeout instead of blocking it.
    done = subprocess.run(
        [sys.executable, "-m", "keras_safe_dist.cli", "report", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert done.returncode == 2
    problem = "not a regular file (a FIFO, socket, device or folder), so not opened"
    assert f"cannot read {tmp_path / 'nan_onset.json'}: {problem}" in done.stderr
    assert f"skipped {tmp_path / 'events.out.tfevents.1.host'}: {problem}" in done.stderr


@pytest.mark.parametrize("text, problem", [
    ("{}", "JSON not of the shape keras_safe_dist writes (ValueError('a NaN onset report holds `epoch` "
           "and `batch` (integers) and `kind` (a string); missing or wrong: epoch, batch, kind'))"),
    ('{"epoch": true, "batch": 1, "kind": "loss"}', "missing or wrong: epoch'))"),
    ("[" * 100000 + "]" * 100000, "JSON nested too deeply to be a report keras_safe_dist writes"),
])
def test_a_nan_onset_json_not_of_the_projects_shape_is_named_with_exit_2(tmp_path, capsys, text, problem):
    (tmp_path / "nan_onset.json").write_text(text)
    code, out, err = run_cli(capsys, str(tmp_path))
    assert code == 2
    assert "NAN001" not in out
    assert f"keras-safe-dist report: cannot read {tmp_path / 'nan_onset.json'}: " in err
    assert problem in err


def test_report_fails_a_stock_model_clipping_per_replica_and_says_it_logs_no_statistics(tmp_path, capsys):
    with strategy_for(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(global_clipnorm=1.0), loss="mse")
    audit = callbacks.AggregationAudit(log_dir=str(tmp_path), on_finding="ignore")
    with pytest.warns(UserWarning, match="Dashboard writes the update statistics .* of a SafeDistributedModel; model '.*' is a Sequential") as caught:
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[audit, callbacks.Dashboard(str(tmp_path))])
    # Once, attributed to the fit() call above.
    assert [w.filename for w in caught if "Dashboard writes" in str(w.message)] == [__file__]
    code, out, _ = run_cli(capsys, str(tmp_path), "--fail-on", "warning")
    assert code == 1
    assert "| aggregation | DIST001 | error | optimizer '" in out
    assert "Update statistics per run:\nnone logged: the update statistics come from a SafeDistributedModel" in out
    assert out.rstrip().endswith("1 finding(s) at or above 'warning': failing.")


def test_a_run_folder_named_in_another_encoding_is_read(tmp_path, capsys):
    # A folder name that is not UTF-8 (bytes from another system's encoding).
    log_dir = tmp_path / "logs"
    summaries.write_scalars(str(log_dir / "run"), {"safe_distributed/grad_norm": 0.5}, step=0)
    os.rename(os.fsencode(log_dir / "run"), os.fsencode(log_dir) + b"/run\xff")
    report = read_log_dir(str(log_dir))
    assert report.warnings == []
    (run,) = report.runs
    assert run.values["grad_norm"] == [0.5]


def test_a_record_with_valid_checksums_but_no_event_is_a_damaged_file(tmp_path):
    from tensorboard.summary.writer.record_writer import RecordWriter

    path = tmp_path / "events.out.tfevents.1.host.1.0.v2"
    with open(path, "wb") as f:
        RecordWriter(f).write(b"\xff\xff not an event")
    report = read_log_dir(str(tmp_path))
    assert [w.path for w in report.warnings] == [str(path)]


class _StopAtBatch(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            raise KeyboardInterrupt("stopped by hand")


def _stopped_in_its_first_epoch(log_dir):
    with strategy_for(1).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    x = np.repeat(X, 4, axis=0)  # 80 samples: 20 batches of 4
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0,
                  callbacks=[callbacks.Dashboard(str(log_dir)), _StopAtBatch(12)])


def test_report_shows_the_update_points_of_a_run_stopped_in_its_first_epoch(tmp_path, capsys):
    _stopped_in_its_first_epoch(tmp_path)
    # Before: "nothing to report ... no logged update statistics", exit 2.
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 0
    assert "| safe_distributed | samples_per_update | 4 | 4 | 4 |" in out
    assert "[safe_distributed] per update: the run logged no epoch (it stopped in its first); 12 update points." in out
    (run,) = read_log_dir(str(tmp_path)).runs
    assert run.per == "update" and len(run.values["grad_norm"]) == 12


def test_report_reads_the_points_before_a_damaged_last_record(tmp_path, capsys):
    _stopped_in_its_first_epoch(tmp_path)
    (path,) = (tmp_path / "safe_distributed").glob("*.tfevents.*")
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the last record cut
    code, out, err = run_cli(capsys, str(tmp_path))
    # Before: "no update statistics could be read from the damaged event files", exit 2.
    assert code == 0
    assert "| safe_distributed | samples_per_update | 4 | 4 | 4 |" in out
    assert f"skipped {path}: event file damaged, read up to it: " in err
    assert "record truncated at byte" in err


def test_report_says_when_two_writers_overlapped_in_one_run(tmp_path, capsys):
    run = tmp_path / "safe_distributed"
    writers = [tf.summary.create_file_writer(str(run), filename_suffix=f".{i}") for i in (0, 1)]
    for step in range(3):  # two runs with one log_dir and run name, at once
        for writer in writers:
            with writer.as_default():
                tf.summary.scalar("safe_distributed/grad_norm", 1.0 + step, step=step)
            writer.flush()
    for writer in writers:
        writer.close()
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert code == 0
    (report_run,) = read_log_dir(str(tmp_path)).runs
    assert len(report_run.notes) == 1
    assert report_run.notes[0].startswith("two writers overlapped: events.out.tfevents.")
    assert "were written at the same time (two runs with one log directory and run name?); their points are merged" in out


def test_report_notes_nothing_for_runs_written_one_after_the_other(tmp_path):
    train(str(tmp_path), 1, epochs=1)
    train(str(tmp_path), 1, epochs=1)
    (run,) = [r for r in read_log_dir(str(tmp_path)).runs if r.run == "safe_distributed"]
    assert run.notes == [] and run.per == "epoch"
