"""Several JAX processes on this machine: exactness, no hang, the bound on a failure, the cost.

    PYTHONPATH=. python3 benchmarks/bench_processes.py [--runs 20] [--kills 10] [--pairs 7]

- exact: each case's largest relative difference from stock Keras on one
  device trained on the same global batches (tests_jax/processes/shards.py);
- runs: 32/33 shards `--runs` times; every run must end, status 0;
- kills: process 1 kills itself (SIGKILL) mid-epoch `--kills` times; the
  seconds until process 0 exits (bound: `keras_safe_dist.initialize`'s timeout);
- cost: the per-step time of even shards (MLP 64-256-256-10, 64 samples per
  process) with the agreement on the global batch over without it, as
  interleaved pairs: the median ratio and the median difference per step.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from keras_safe_dist.scale_out import launch

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDS = os.path.join(HERE, "..", "tests_jax", "processes", "shards.py")
COST = os.path.join(HERE, "_processes_cost.py")
TIMEOUT = 20


def env(extra=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DISTRIBUTION_")}
    base.pop("XLA_FLAGS", None)
    base.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    base.update(extra or {})
    return base


def start(script, args, count):
    ports = launch.free_ports(count)
    return [
        subprocess.Popen(
            [sys.executable, script, *args], env=env(launch.jax_env(ports, i)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True,
        )
        for i in range(count)
    ]


def finish(processes, limit=300):
    """Exit codes, end times and outputs; kills what is left after `limit` seconds."""
    deadline = time.monotonic() + limit
    ends = [None] * len(processes)
    while any(e is None for e in ends) and time.monotonic() < deadline:
        for i, p in enumerate(processes):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.time()
        time.sleep(0.05)
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    outputs = [p.communicate()[0] for p in processes]
    return [p.returncode for p in processes], ends, outputs


def relative(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def exact(sizes, accumulation):
    with tempfile.TemporaryDirectory() as out:
        options = ["--accumulation", str(accumulation)]
        subprocess.run([sys.executable, SHARDS, out, sizes, "--reference", *options], env=env(), check=True, capture_output=True, timeout=300)
        count = len(sizes.split(","))
        codes, _, outputs = finish(start(SHARDS, [out, sizes, *options], count))
        assert codes == [0] * count, outputs
        reference = np.load(os.path.join(out, "reference.npz"))
        worst, offset = 0.0, 0
        for process, rows in enumerate(int(n) for n in sizes.split(",")):
            got = np.load(os.path.join(out, f"process_{process}.npz"))
            for key in reference.files:
                if key.startswith("arr_") or key == "evaluation":
                    worst = max(worst, relative(got[key], reference[key]))
            if rows:
                worst = max(worst, relative(got["predictions"], reference["predictions"][offset : offset + rows]))
            offset += rows
        return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()

    for sizes, accumulation in (("32,33", 2), ("32,33", 1), ("30,31,35", 1), ("30,31,35", 2), ("30,0,35", 1), ("0,33", 2)):
        print(f"exact {sizes} accumulation {accumulation}: {exact(sizes, accumulation):.2e}", flush=True)

    walls = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as out:
            began = time.time()
            codes, ends, outputs = finish(start(SHARDS, [out, "32,33"], 2))
            assert codes == [0, 0], outputs
            walls.append(max(ends) - began)
    print(f"runs 32/33: {len(walls)} of {args.runs} ended with status 0; longest {max(walls):.1f} s", flush=True)

    bounds = []
    for _ in range(args.kills):
        with tempfile.TemporaryDirectory() as out:
            codes, ends, outputs = finish(start(SHARDS, [out, "32,33", "--die", "1:2:1", "--timeout", str(TIMEOUT)], 2))
            killed_at = float(outputs[1].split("process 1 fails at step 2: ")[1].split()[0])
            named = "process 1: stopped answering" in outputs[0]
            bounds.append((ends[0] - killed_at, codes[0], named))
    within = sum(1 for seconds, code, named in bounds if seconds < TIMEOUT and code != 0 and named)
    print(
        f"kills: {within} of {args.kills} ended process 0 (non-zero, naming process 1) within "
        f"{TIMEOUT} s; seconds: median {statistics.median(b[0] for b in bounds):.1f}, "
        f"longest {max(b[0] for b in bounds):.1f}",
        flush=True,
    )

    codes, _, outputs = finish(start(COST, [str(args.pairs)], 2), limit=600)
    assert codes == [0, 0], outputs
    pairs = [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]
    ratios = [p["agreed"] / p["keras"] for p in pairs]
    extra = [(p["agreed"] - p["keras"]) * 1e3 for p in pairs]
    print(
        f"cost (even shards, 64 per process, {len(pairs)} interleaved pairs): median ratio "
        f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
        f"median per-step difference {statistics.median(extra):+.3f} ms of "
        f"{statistics.median(p['keras'] for p in pairs) * 1e3:.2f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
