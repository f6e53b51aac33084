"""Two MultiWorkerMirroredStrategy workers on 127.0.0.1 (each test starts real processes)."""

import json
import pathlib
import threading

import keras
import numpy as np
import pytest

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.scale_out.launch import WorkerGroup

from conftest import relative_error
from conftest import strategy_for

WORKER = str(pathlib.Path(__file__).resolve().parent / "mw_worker.py")
TIMEOUT = 240  # seconds; a hung collective fails the test instead of CI


def worker_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(45, 4)).astype("float32")
    return x, (x @ rng.normal(size=(4, 1)) + 0.1).astype("float32")


def build(cls, **options):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(1)(hidden), **options)


def one_device_reference(epochs, steps, clipnorm=None):
    """Stock Keras on one device, one batch per accumulation group."""
    x, y = worker_data()
    model = build(keras.Model)
    model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=clipnorm), loss="mse")
    model.fit(x, y, batch_size=10 * steps, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def run_workers(args, on_line=None):
    lines = []

    def record(index, line):
        lines.append((index, line))
        if on_line is not None:
            on_line(index, line)

    group = WorkerGroup(WORKER, workers=2, args=args, on_line=record).start()
    codes = group.wait(TIMEOUT)
    results = {i: json.loads(line[len("RESULT "):]) for i, line in lines if line.startswith("RESULT ")}
    return codes, results, lines


def weights(result, inputs):
    return [np.array(w, dtype="float32") for w in result[inputs]["weights"]]


@pytest.mark.processes
def test_two_workers_match_single_process_runs(tmp_path):
    log_dir = tmp_path / "logs"
    codes, results, lines = run_workers(["--steps", "2", "--clipnorm", "1.0", "--epochs", "2", "--log-dir", str(log_dir)])
    assert codes == [0, 0], [line for _, line in lines][-20:]
    assert results[0]["chief"] is True and results[1]["chief"] is False
    reference = one_device_reference(epochs=2, steps=2, clipnorm=1.0)
    x, y = worker_data()
    with strategy_for(2).scope():
        mirrored = build(SafeDistributedModel, gradient_accumulation_steps=2, global_clipnorm=1.0)
        mirrored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mirrored.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    for inputs in ("numpy", "dataset"):
        first, second = weights(results[0], inputs), weights(results[1], inputs)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)  # workers hold identical weights
        assert relative_error(reference, first) < 1e-5
        assert relative_error(mirrored.get_weights(), first) < 1e-5
        # 45 samples, micro-batch 10, 2 per update: 3 updates per epoch.
        assert results[0][inputs]["iterations"] == 6
        assert results[0][inputs]["history"]["samples_per_update"] == [5.0, 5.0]
        assert results[0][inputs]["history"] == results[1][inputs]["history"]
        # Every worker audits alike; only the chief writes the reports and events.
        assert results[0][inputs]["audits"] == results[1][inputs]["audits"] == [
            f"{name} audit: 0 errors, 0 warnings, 0 info" for name in ("scope", "aggregation", "training_mode")
        ]
        written = sorted(p.name for p in (log_dir / inputs).iterdir())
        assert [n for n in written if n.endswith(".json")] == [
            "audit_aggregation.json", "audit_scope.json", "audit_training_mode.json",
        ]
        # events.out.tfevents.<time>.<host>.<pid>.<index>.v2
        writers = {n.rsplit(".", 3)[1] for n in written if ".tfevents." in n}
        assert writers == {str(results[0][inputs]["pid"])}


@pytest.mark.processes
def test_nan_in_one_workers_share_stops_both_workers_with_the_same_report(tmp_path):
    # Row 23 is in global batch 2 (rows 20-29), in the chief's share (rows 20-24).
    args = ["--steps", "1", "--epochs", "2", "--inputs", "numpy", "--nan-row", "23", "--log-dir", str(tmp_path)]
    codes, results, lines = run_workers(args)
    assert codes == [0, 0], [line for _, line in lines][-20:]
    chief, other = (results[i]["numpy"]["nan_onset"] for i in (0, 1))
    fields = [{k: r[k] for k in ("epoch", "batch", "kind", "replicas", "layer")} for r in (chief, other)]
    # The other worker's share was finite; it knows from the reduced flags.
    assert fields[0] == fields[1] == {"epoch": 0, "batch": 2, "kind": "inputs", "replicas": [0], "layer": None}
    assert other["notes"] == ["The shares that fired were not captured on this worker."]
    # Both stopped after the onset batch, whose update was skipped.
    assert results[0]["numpy"]["iterations"] == results[1]["numpy"]["iterations"] == 2
    assert results[0]["numpy"]["history"]["skipped_updates"] == [1.0]
    # Only the chief writes: the report and its own replica's share.
    assert other["files"] == {} and sorted(chief["files"]) == ["batch", "report"]
    batch = np.load(tmp_path / "nan_onset_batch.npz")
    assert np.isnan(batch["x"]).sum() == 1 and batch["replica"].tolist() == [0] * 5
    assert json.loads((tmp_path / "nan_onset.json").read_text())["kind"] == "inputs"


@pytest.mark.processes
def test_killed_worker_resumes_from_backup_and_matches_uninterrupted_run(tmp_path):
    backup = tmp_path / "backup"
    args = ["--steps", "2", "--epochs", "3", "--inputs", "numpy", "--backup", str(backup)]
    group_holder = {}
    killed = threading.Event()

    def kill_mid_epoch(index, line):
        # Epoch 0 is backed up; kill worker 1 in the middle of epoch 1.
        if index == 1 and line == "BATCH 1 1" and not killed.is_set():
            killed.set()
            group_holder["group"].kill(1)

    lines = []
    group = WorkerGroup(
        WORKER, workers=2, args=args + ["--delay", "0.5"],
        on_line=lambda i, line: (lines.append((i, line)), kill_mid_epoch(i, line)),
    )
    group_holder["group"] = group
    group.start()
    codes = group.wait(TIMEOUT)
    assert killed.is_set(), [line for _, line in lines][-20:]
    assert codes[1] != 0 and codes[0] != 0  # the survivor was killed with the group
    assert json.loads((backup / "training_metadata.json").read_text())["epoch"] == 1
    # The killed non-chief worker's own copy stays under the backup directory, and the
    # killed chief's lock, which the resumed run takes over (its process is gone).
    assert sorted(p.name for p in backup.iterdir()) == [
        ".keras_safe_dist.lock", "epoch_1.weights.h5", "training_metadata.json", "worker_1"
    ]

    codes, results, lines = run_workers(args)
    assert codes == [0, 0], [line for _, line in lines][-20:]
    resumed_batches = [line for i, line in lines if i == 0 and line.startswith("BATCH")]
    assert resumed_batches[0] == "BATCH 1 0"  # resumed at the start of epoch 1
    reference = one_device_reference(epochs=3, steps=2)
    for index in (0, 1):
        assert relative_error(reference, weights(results[index], "numpy")) < 1e-5
    assert not backup.exists()  # deleted after a normal end


@pytest.mark.parametrize("workers", [0, -1, "2", True])
def test_launcher_rejects_bad_worker_counts(workers):
    with pytest.raises(ValueError, match=f"Received: workers={workers!r}"):
        WorkerGroup(WORKER, workers=workers)


def test_launcher_rejects_missing_script(tmp_path):
    with pytest.raises(FileNotFoundError, match="No script to launch at"):
        WorkerGroup(str(tmp_path / "missing.py"))


@pytest.mark.processes
def test_two_workers_run_several_steps_per_execution_exactly():
    # 5 micro-batches a worker-epoch in executions of 3: the second is partial.
    codes, results, lines = run_workers(["--steps", "2", "--epochs", "2", "--execution", "3"])
    assert codes == [0, 0], [line for _, line in lines][-20:]
    reference = one_device_reference(epochs=2, steps=2)
    for inputs in ("numpy", "dataset"):
        first, second = weights(results[0], inputs), weights(results[1], inputs)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)
        assert relative_error(reference, first) < 1e-5
        assert results[0][inputs]["iterations"] == 6
