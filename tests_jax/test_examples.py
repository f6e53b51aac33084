"""The JAX examples that need several processes run as their docstrings say, under the launcher."""

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
LAUNCH_TIMEOUT = 150  # the launcher's --timeout: it kills the workers after this
HARD = 180  # and this test kills the launcher
RESULT = re.compile(
    r"^\[worker (\d+)\] processes: (\d+), devices: (\d+), "
    r"loss: (\S+) after epoch 1, (\S+) after epoch 5$"
)


def _launch(script, workers, cwd):
    """`keras-safe-dist launch --backend jax` of `script`; returns the launcher's output lines.

    After `HARD` seconds the launcher is killed, and its watcher process kills the workers.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_DISTRIBUTION_", "SLURM_"))}
    env.pop("XLA_FLAGS", None)  # one CPU device per process, as the example's docstring runs it
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [
            sys.executable, "-m", "keras_safe_dist", "launch", "--backend", "jax",
            "--workers", str(workers), "--timeout", str(LAUNCH_TIMEOUT), str(EXAMPLES / script),
        ],
        capture_output=True, text=True, timeout=HARD, env=env, cwd=cwd, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines()


def _result(lines):
    """(worker, processes, devices, first loss, last loss) of the one line the chief prints."""
    found = [RESULT.match(line) for line in lines]
    found = [match.groups() for match in found if match]
    assert len(found) == 1, lines  # the chief's, not one per process
    worker, processes, devices, first, last = found[0]
    return int(worker), int(processes), int(devices), float(first), float(last)


@pytest.mark.processes
def test_jax_processes_trains_two_processes_as_one_device_on_the_whole_data(tmp_path):
    worker, processes, devices, first, last = _result(_launch("jax_processes.py", 2, tmp_path))
    assert (worker, processes, devices) == (0, 2, 2)
    assert math.isfinite(last) and last < 0.6 * first
    # The same script as one process of one device, on all 1024 rows: the
    # same global batches, so the same losses up to float rounding.
    alone = _result(_launch("jax_processes.py", 1, tmp_path))
    assert alone[:3] == (0, 1, 1)
    assert alone[3] == pytest.approx(first, abs=2e-4)  # printed with 4 decimals
    assert alone[4] == pytest.approx(last, abs=3e-6)  # with 6
