"""benchmarks/bench_device_arrays.py, small, on one CPU device, in a process of its own.

Its times are not asserted (a timed test cannot fail honestly); what it
kept and freed is exact, and says that each mode did what it is named for.
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "bench_device_arrays.py")


def _run(*arguments, timeout):
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, SCRIPT, *arguments],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )


def test_each_mode_is_timed_and_frees_what_it_kept(tmp_path):
    path = tmp_path / "report.json"
    done = _run("--steps", "41", "--keep", "8", "--rounds", "2", "--json", str(path), timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "a kept batch freed:" in done.stdout, done.stdout
    report = json.loads(path.read_text())
    assert (report["steps"], report["keep"], report["rounds"]) == (41, 8, 2)
    modes = report["modes"]
    assert list(modes) == [
        "stock", "kept", "kept, freed in bulk", "kept, freed in a thread", "kept on the host",
        "one more output",
    ]
    assert modes["stock"]["ratio_to_stock"] == 1.0
    freed = {mode: row["kept_batches_freed_per_round"] for mode, row in modes.items()}
    assert freed == {
        "stock": 0,
        "kept": 41 - 8,  # one a step once 8 are kept
        "kept, freed in bulk": 32,  # 32 at once, when 8 + 32 are kept
        "kept, freed in a thread": 41 - 8,
        "kept on the host": 41 - 8,
        "one more output": 0,
    }
    for row in modes.values():
        assert row["step_us"] > 0 and row["ratio_to_stock"] > 0
    for key in (
        "freed_one_at_a_time_us_per_batch",
        "freed_in_bulk_in_loop_us_per_batch",
        "freed_after_wait_us_per_batch",
    ):
        assert report[key] > 0, key


def test_bad_sizes_are_refused():
    done = _run("--steps", "10", "--keep", "10", timeout=60)
    assert done.returncode == 2
    assert (
        "--steps must be >= 2, --keep >= 1 and below --steps, and --rounds >= 1. "
        "Received: --steps 10, --keep 10, --rounds 15"
    ) in done.stderr
