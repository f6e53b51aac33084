"""benchmarks/host_breakdown.py --quick on one CPU device, in a process of its own.

Its figures are host times (not asserted: a timed test cannot fail
honestly); its call counts are exact, and they say what it timed.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("host_breakdown") / "report.json"
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "host_breakdown.py"), "--quick",
            "--models", "mlp", "--fits", "2", "--steps-per-execution", "2",
            "--json", str(path),
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "record_batch" in done.stdout, done.stdout[-2000:]
    return json.loads(path.read_text())


def test_each_configuration_times_its_own_calls(report):
    result = report["models"]["mlp"]
    steps = result["steps"]  # 20 steps of 64, 2 per execution: 10 executions
    assert (steps, result["batch"], report["steps_per_execution"]) == (20, 64, 2)
    calls = {
        config: {part: row["calls_per_fit"] for part, row in result[config].items()}
        for config in ("stock", "safe", "safe, detector")
    }
    assert calls["stock"] == {"fit": 1, "train_function": 10}
    assert calls["safe"]["train_function"] == 10
    assert calls["safe"]["JAXUpdateEngine.begin_fit"] == 1
    assert not any(part.startswith(("NaNOnsetDetector", "OnsetWatch")) for part in calls["safe"])
    detector = calls["safe, detector"]
    assert detector["OnsetWatch.record_batch"] == steps  # one batch kept a step
    assert detector["OnsetWatch.take"] == 10  # the record taken out once an execution
    assert detector["NaNOnsetDetector.on_train_batch_begin"] == 10
    assert detector["OnsetWatch.read_with_weights"] == 1  # the epoch's end
    assert detector["OnsetWatch.reset"] == 1
    for config in calls:
        assert result[config]["fit"]["us_per_fit"] > 0


def test_bad_counts_are_refused():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_breakdown.py"), "--fits", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 2
    assert "--fits and --steps-per-execution must be integers >= 1. Received: 0, 1" in done.stderr
