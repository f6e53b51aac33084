"""The examples run offline, finish quickly and print what they promise."""

import os
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_accumulate_uneven_applies_partial_group_and_clips():
    lines = run_example("accumulate_uneven.py").splitlines()
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


def test_multi_worker_launches_two_workers_that_agree():
    lines = run_example("multi_worker.py").splitlines()
    checksums = {line.split()[1]: line.split()[-1] for line in lines if "weights checksum" in line}
    assert sorted(checksums) == ["0]", "1]"]
    assert checksums["0]"] == checksums["1]"]
    summary = [line for line in lines if "epoch " in line and "loss" in line]
    assert [line.split()[:3] for line in summary] == [["[worker", "0]", "epoch"]] * 3
    assert all(line.endswith("samples per update 80") for line in summary)


def test_mirrored_with_callbacks_audits_clean_and_reports_statistics():
    out = run_example("mirrored_with_callbacks.py")
    lines = out.splitlines()
    losses = [float(line.split()[3].rstrip(",")) for line in lines if line.startswith("epoch ")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "scope audit: 0 errors, 0 warnings, 0 info" in lines
    assert "aggregation audit: 0 errors, 0 warnings, 0 info" in lines
    assert "training_mode audit: 0 errors, 0 warnings, 0 info" in lines
    assert "none (3 audit reports read)" in lines
    assert any(line.startswith("| . | samples_per_update | 64 |") for line in lines)
    assert lines[-1].startswith("Open the dashboard with: tensorboard --logdir ")


def test_subclassed_model_matches_stock_keras_and_reloads():
    lines = run_example("subclassed_model.py").splitlines()
    assert lines[0] == "replicas: 2, micro-batch 16, accumulation 3"
    assert all(line.endswith("last update 8 samples") for line in lines[1:4])
    difference = float(lines[4].rsplit(" ", 1)[1])
    assert difference < 1e-5
    assert lines[5] == "reloaded ResidualRegressor: accumulation 3, global_clipnorm 1.0, same predictions: True"


def test_hunt_nan_names_batch_replica_and_layer_and_restores():
    lines = run_example("hunt_nan.py").splitlines()
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
    assert lines[-1] == "weights finite after restore: True"
