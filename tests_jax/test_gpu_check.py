"""benchmarks/gpu_check.py --quick on one CPU device, in a process of its own.

The script fixes its backend and devices at import, so it runs in a
subprocess with a clean environment: without the two-device XLA flag that
conftest.py sets for this process, so on one CPU device.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _strict(constant):
    raise ValueError(f"non-finite number in the JSON: {constant}")


def _run_check(path, *options):
    """`(JSON report, stdout)` of `gpu_check.py --quick --models mlp` with `options`."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    command = [
        sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--models", "mlp",
        "--json", str(path), *options,
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tensorflow imported:" in done.stdout, done.stdout[-2000:]
    return json.loads(path.read_text(), parse_constant=_strict), done.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    # About 16 s on the idle 2-core VM, 30 s while other tests run beside it.
    path = tmp_path_factory.mktemp("gpu_check") / "report.json"
    return _run_check(path, "--deterministic", "--steps-per-execution", "2")[0]


def test_runs_on_one_cpu_device_and_reports_versions(report):
    assert report["device"] == {"kind": "cpu", "platform": "cpu", "count": 1}
    assert report["versions"]["jax"] and report["versions"]["keras"]
    assert report["quick"] is True
    assert list(report["models"]) == ["mlp"]
    assert report["models"]["mlp"]["name"] == "MLP 64-256-256-10"


def test_each_exactness_cell_has_its_controls(report):
    # On a CPU stock Keras is reproducible (0 against itself); re-ordering
    # each batch's samples moves the weights by rounding only.
    for optimizer, runs in report["models"]["mlp"]["exactness"].items():
        for precision, cells in runs.items():
            assert cells["stock_repeat"] == 0.0, (optimizer, precision)
            assert 0 < cells["stock_reordered"] <= 1e-5, (optimizer, precision, cells)


def test_deterministic_ops_and_steps_per_execution_are_recorded(report):
    assert report["deterministic_ops"] is True
    assert report["steps_per_execution"] == 2


@pytest.mark.parametrize("option", ["--steps-per-execution", "--steps-scale"])
def test_a_count_below_one_is_refused(option):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), option, "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2
    assert f"{option} must be an integer >= 1. Received: 0" in done.stderr


def test_safe_model_matches_stock_at_highest_precision(report):
    # Measured on the 2-core VM: 0 for k=1, 1.2e-8 (SGD) and 3.0e-8 (Adam) for k=4.
    exactness = report["models"]["mlp"]["exactness"]
    for optimizer in ("sgd", "adam"):
        for key in ("accumulation_1", "accumulation_4"):
            assert 0 <= exactness[optimizer]["highest"][key] <= 1e-7, (optimizer, key)
    assert 0 <= exactness["sgd"]["default"]["accumulation_4"] <= 1e-7


def test_highest_precision_reaches_every_compiled_product(report):
    traced = report["models"]["mlp"]["traced"]
    assert traced["highest"]["ops"] > 0
    assert traced["highest"]["highest"] == traced["highest"]["ops"]
    assert traced["default"]["ops"] > 0
    assert traced["default"]["highest"] == 0


def test_stock_floor_is_a_small_finite_number(report):
    # Measured: 1.9e-7 at both precisions (the CPU ignores the setting).
    for precision in ("default", "highest"):
        floor = report["models"]["mlp"]["floor"][precision]
        assert math.isfinite(floor) and 0 < floor <= 1e-5, (precision, floor)


def test_speed_ratios_are_positive_and_finite(report):
    for key in ("speed", "detector"):
        row = report["models"]["mlp"][key]
        low, high = row["ratio_interval"]
        assert 0 < low <= row["ratio"] <= high < math.inf, (key, row)
        assert math.isfinite(row["per_step_us"]), (key, row)
        assert row["baseline_epoch_ms"] > 0 and row["epoch_ms"] > 0, (key, row)
        assert (row["batch"], row["steps"], row["rounds"]) == (64, 20, 3), (key, row)
    assert report["models"]["mlp"]["detector"]["onset_reported"] is False


def test_runs_without_importing_tensorflow(report):
    # Also where TensorFlow is installed: nothing on the JAX path imports it.
    assert report["tensorflow_imported"] is False


def test_only_speed_with_a_profile_skips_the_exactness_runs(tmp_path):
    report, _ = _run_check(tmp_path / "speed.json", "--rounds", "1", "--only", "speed", "--profile")
    mlp = report["models"]["mlp"]
    assert mlp["exactness"] == {} and mlp["floor"] == {}
    assert mlp["speed"]["rounds"] == 1 and mlp["speed"]["ratio"] > 0
    # A CPU's trace has no device plane: the profile is there, and empty.
    assert set(mlp["profile"]) == {"stock", "safe", "safe, detector"}
    assert all(entry["lines"] == {} for entry in mlp["profile"].values())


def test_controls_steps_scale_and_host_profile(tmp_path):
    report, stdout = _run_check(
        tmp_path / "report.json", "--only", "speed", "--rounds", "2", "--controls",
        "--steps-scale", "2", "--host-profile", "--ablate",
    )
    assert (report["controls"], report["steps_scale"], report["ablate"]) == (True, 2, True)
    mlp = report["models"]["mlp"]
    assert mlp["speed"]["steps"] == 40  # 20 quick steps, twice
    # On a CPU the norm is summed per tensor: the control joins the gradients.
    controls = mlp["speed"]["controls"]
    assert set(controls) == {"safe, joined norm", "safe, skip_nonfinite=False"}
    for row in controls.values():
        low, high = row["ratio_interval"]
        assert 0 < low <= row["ratio"] <= high < math.inf, row
    profiles = mlp["host_profile"]
    assert set(profiles) == {"stock", "safe", "safe, detector"}
    for config, profile in profiles.items():
        # Which functions lead differs by Python (3.12's cProfile also sees
        # Keras's callback thread, and may leave out the outer fit()).
        assert profile["epoch_s"] > 0, config
        assert profile["top"] and all(row["us_per_step"] > 0 for row in profile["top"]), config
    functions = [row["function"] for row in profiles["safe, detector"]["top"]]
    assert any("train_function" in name for name in functions), functions
    assert "host profile MLP 64-256-256-10, safe, detector" in stdout
    # Each part of the detector left out, timed against the safe model.
    ablated = mlp["detector"]["controls"]
    assert set(ablated) == {
        "detector, no batches kept", "detector, no checks", "detector, no epoch read",
        "detector, step only",
    }
    for row in ablated.values():
        low, high = row["ratio_interval"]
        assert 0 < low <= row["ratio"] <= high < math.inf, row
    assert "detector, step only / safe" in stdout
    # The detector's cost per fit(): fits of one step, three rounds per round.
    per_fit = mlp["detector_per_fit"]
    assert (per_fit["steps"], per_fit["rounds"]) == (1, 6)
    low, high = per_fit["ratio_interval"]
    assert 0 < low <= per_fit["ratio"] <= high < math.inf, per_fit
    assert math.isfinite(per_fit["per_step_us"])
    assert f"{per_fit['per_step_us']:>+7.0f}µs/fit" in stdout


@pytest.mark.parametrize(
    "leave_out", [(), ("batches",), ("checks",), ("epoch_read",), ("batches", "checks", "epoch_read")]
)
def test_ablated_detector_leaves_out_only_its_parts(leave_out, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check
    import keras
    import numpy as np

    from keras_safe_dist import SafeDistributedModel

    inputs = keras.Input((4,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    detector = gpu_check.AblatedDetector(leave_out)
    calls = {"start_read": 0, "read_with_weights": 0, "record_batch": 0}
    original = gpu_check.NaNOnsetDetector.on_train_begin

    def counted_begin(self, logs=None):
        original(self, logs)
        watch = self._watch
        for name in calls:
            method = getattr(watch, name)

            def counted(*args, _method=method, _name=name):
                calls[_name] += 1
                return _method(*args)

            setattr(watch, name, counted)

    monkeypatch.setattr(gpu_check.NaNOnsetDetector, "on_train_begin", counted_begin)
    x = np.ones((40, 4), "float32")
    model.fit(x, x[:, :1], batch_size=1, epochs=1, verbose=0, callbacks=[detector])
    # 40 steps: one check (at step 32, check_every's default), one epoch's end.
    assert calls == {
        "start_read": 0 if "checks" in leave_out else 1,
        "read_with_weights": 0 if "epoch_read" in leave_out else 1,
        "record_batch": 0 if "batches" in leave_out else 40,
    }
