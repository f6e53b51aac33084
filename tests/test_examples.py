"""The examples run offline, finish quickly and print what they promise."""

import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


# What examples and our callbacks could leave in the system temp folder.
TEMP_PREFIXES = ("hunt_nan_", "keras_safe_dist_")


def _temp_entries():
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(TEMP_PREFIXES)}


def run_example(name, cwd):
    """Runs an example in `cwd`, where it keeps its logs; returns its output."""
    # Without TF_CPP_MIN_LOG_LEVEL: each example keeps TensorFlow quiet itself.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    before = _temp_entries()
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _temp_entries() - before == set()
    # TensorFlow's C++ start-up lines stay out of the output.
    noise = [
        line for line in (result.stdout + result.stderr).splitlines()
        if any(mark in line for mark in _STARTUP_LINES)
    ]
    assert noise == []
    return result.stdout


_STARTUP_LINES = ("absl::InitializeLog", "cudart_stub", "cuInit", "cpu_feature_guard", "rebuild TensorFlow")


def test_accumulate_uneven_applies_partial_group_and_clips(tmp_path):
    lines = run_example("accumulate_uneven.py", tmp_path).splitlines()
    assert lines[0] == (
        "replicas: 2, micro-batches per epoch: 16, updates per epoch: 6 "
        "(5 x 192 samples + 1 x 40)"
    )
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5"]
    losses = [float(row[1]) for row in rows]
    assert losses[-1] < losses[0]
    assert all(float(row[5]) == 40.0 for row in rows)  # samples in the partial update
    assert all(float(row[4]) == 0.0 for row in rows)  # no skipped updates
    assert float(rows[0][3]) == 1.0  # every early update is clipped


def test_multi_worker_launches_two_workers_that_agree(tmp_path):
    lines = run_example("multi_worker.py", tmp_path).splitlines()
    checksums = {line.split()[1]: line.split()[-1] for line in lines if "weights checksum" in line}
    assert sorted(checksums) == ["0]", "1]"]
    assert checksums["0]"] == checksums["1]"]
    summary = [line for line in lines if "epoch " in line and "loss" in line]
    assert [line.split()[:3] for line in summary] == [["[worker", "0]", "epoch"]] * 3
    assert all(line.endswith("samples per update 80") for line in summary)


def test_mirrored_with_callbacks_audits_clean_and_reports_statistics(tmp_path):
    out = run_example("mirrored_with_callbacks.py", tmp_path)
    lines = out.splitlines()
    losses = [float(line.split()[3].rstrip(",")) for line in lines if line.startswith("epoch ")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "scope audit: 0 errors, 0 warnings, 0 info" in lines
    assert "aggregation audit: 0 errors, 0 warnings, 0 info" in lines
    assert "training_mode audit: 0 errors, 0 warnings, 0 info" in lines
    assert "none (3 audit reports read)" in lines
    assert any(line.startswith("| safe_distributed | samples_per_update | 64 |") for line in lines)
    log_dir = tmp_path / "logs" / "mirrored_with_callbacks"
    assert lines[-1] == f"Open the dashboard with: tensorboard --logdir {os.path.join('logs', 'mirrored_with_callbacks')}"
    assert (log_dir / "audit_scope.json").is_file()  # kept for TensorBoard


def test_subclassed_model_matches_stock_keras_and_reloads(tmp_path):
    lines = run_example("subclassed_model.py", tmp_path).splitlines()
    assert lines[0] == "replicas: 2, micro-batch 16, accumulation 3"
    assert all(line.endswith("last update 8 samples") for line in lines[1:4])
    difference = float(lines[4].rsplit(" ", 1)[1])
    assert difference < 1e-5
    assert lines[5] == "reloaded ResidualRegressor: accumulation 3, global_clipnorm 1.0, same predictions: True"


def test_hunt_nan_names_batch_replica_and_layer_and_restores(tmp_path):
    lines = run_example("hunt_nan.py", tmp_path).splitlines()
    assert lines[0].startswith("NaN onset at epoch 0, batch 9, replica 1: a layer output that is non-finite")
    fields = dict(line.split(": ", 1) for line in lines[2:9])
    assert fields == {
        "epoch": "0",
        "batch": "9",
        "kind": "activations",
        "layer": "safe_log",
        "replica": "1",
        "variables": "[]",
        "restored_to": "before this batch",
    }
    assert "files: ['nan_onset.json', 'nan_onset_batch.npz']" in lines
    assert "finding: NAN001 safe_log" in lines
    assert lines[-2] == "weights finite after restore: True"
    assert lines[-1] == "report files in logs/hunt_nan; keras-safe-dist report logs/hunt_nan reads them"
    assert (tmp_path / "logs" / "hunt_nan" / "nan_onset.json").is_file()


@pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="needs the [jax] extra"
)
def test_jax_data_parallel_trains_audits_and_reports_on_jax(tmp_path):
    # Its own process: it sets KERAS_BACKEND=jax and two CPU devices itself.
    lines = run_example("jax_data_parallel.py", tmp_path).splitlines()
    assert lines[0] == "devices: 2, micro-batches per epoch: 16, updates per epoch: 8"
    epochs = [line.split() for line in lines[1:4]]
    losses = [float(row[3].rstrip(",")) for row in epochs]
    assert losses[-1] < losses[0]
    assert all(line.endswith("last update 104 samples") for line in lines[1:4])
    for name in ("scope", "aggregation", "training_mode"):
        assert f"{name} audit: 0 errors, 0 warnings, 1 info (JAX001)" in lines
    assert "NaN onset: none" in lines
    assert "$ keras-safe-dist report logs/jax_data_parallel  (exit status 0)" in lines
    assert "| safe_distributed | samples_per_update | 104 | 104 | 104 |" in lines
    assert (tmp_path / "logs" / "jax_data_parallel" / "audit_scope.json").is_file()
