"""Probe: `fit` under MultiWorkerMirroredStrategy with two worker processes.

Stock Keras 3 cannot `fit` under MultiWorkerMirroredStrategy: building the
model from the first distributed batch converts a `PerReplica` value to a
tensor and fails. SafeDistributedModel builds from one replica's input
specs and reshapes its logs for the cross-worker reduction. Two workers
(`mw_worker`) run on 127.0.0.1 with free ports, one CPU replica each, under
a hard timeout. Crash or not: the figure is the relative deviation of the
update from one device (0 is correct), or the error. Skipped, with the
reason, when no local port can be bound.
"""

import json
import os
import pathlib

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.scale_out.launch import WorkerGroup

__all__ = ["PROBE", "TIMEOUT", "WORKERS"]

WORKERS = 2
TIMEOUT = 60  # seconds per group of workers
WORKER_MODULE = "keras_safe_dist.doctor.probes.mw_worker"
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[3])


def run(strategy=None):
    """Runs both sides in one group of workers; retries the safe side alone if needed.

    `strategy` is unused: the workers make their own.
    """
    try:
        results, problem = _run_group(["stock", "safe"])
    except OSError as error:
        reason = f"skipped: cannot bind a port on 127.0.0.1 ({error})"
        return Side(None, reason), Side(None, reason)
    stock = results.get("stock") or Side(False, problem)
    if "safe" not in results:
        # A stock failure on one worker can leave the other stuck in a
        # collective; give SafeDistributedModel fresh workers.
        results, problem = _run_group(["safe"])
    safe = results.get("safe") or Side(False, problem)
    return stock, safe


def _run_group(sides):
    """Starts the workers; returns ({side: Side} agreed by all workers, problem text)."""
    lines = []
    path = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": _PACKAGE_ROOT + (os.pathsep + path if path else "")}
    group = WorkerGroup(
        None, workers=WORKERS, args=["--sides", ",".join(sides)], env=env,
        on_line=lambda index, line: lines.append((index, line)),
        module=WORKER_MODULE,
    ).start()
    try:
        codes = group.wait(TIMEOUT)
    except TimeoutError:
        codes, problem = None, f"TimeoutError: workers still running after {TIMEOUT} s; killed"
    else:
        problem = f"workers exited with status {codes}"
        tail = [line for _, line in lines if line.strip()][-1:]
        if tail and any(codes):
            problem += f": {tail[0][:160]}"
    per_worker = {}
    for index, line in lines:
        if line.startswith("RESULT "):
            record = json.loads(line[len("RESULT "):])
            per_worker.setdefault(record.pop("side"), {})[index] = record
    results = {}
    for side, records in per_worker.items():
        if len(records) < WORKERS:
            continue
        first = records[0]
        if any(r["ok"] != first["ok"] for r in records.values()):
            verdicts = ", ".join(f"worker {i}: {r['figure']}" for i, r in sorted(records.items()))
            results[side] = Side(False, f"workers disagree ({verdicts})")
        else:
            results[side] = Side(first["ok"], first["figure"])
    return results, problem


PROBE = Probe(
    name="multi-worker-fit",
    checks=(
        f"fit under MultiWorkerMirroredStrategy, {WORKERS} worker processes on 127.0.0.1: "
        "crash or not (figure: relative deviation of the update from one device)"
    ),
    run=run,
)
