"""What device arrays cost the thread that dispatches JAX steps: kept, freed, returned.

On JAX the NaNOnsetDetector keeps each step's batch by reference for the
replay (freeing one as each step pushes it out) and has the step return its
record as one more output. On an H200 host both showed in host timings
(docs/benchmarks.md): a batch freed as a step pushed it out took 37 to 52 µs
by attribution, against about 12 µs a batch freed in bulk when a fit began.
This benchmark isolates those costs with a small jitted step (a linear
model's SGD update, its weights donated), fed as Keras feeds a step on an
accelerator: each batch placed on the device one step ahead. Modes:

- `stock`: each batch dropped once its step is dispatched (Keras's loop);
- `kept`: the last `--keep` batches kept in a bounded deque, so that each
  step frees the oldest (the detector's replay);
- `kept, freed in bulk`: the same batches kept, the oldest 32 freed at once
  every 32 steps (as a check every 32 steps could);
- `kept, freed in a thread`: the same as `kept`, with each pushed-out batch
  handed to another thread, which drops it (as if Keras's callback thread
  freed it);
- `kept on the host`: the same number of batches kept, as the host arrays
  each was placed from (the device's copies dropped as in `stock`);
- `one more output`: stock's loop with a step that also returns a small
  int32 vector, dropped at the next step (the detector's record).

Rounds of `--steps` steps per mode in rotating order, forward then
backward, after a warm-up round. Per mode: the median time a step of the
dispatching loop (the device waited for at the end) and its ratio to
`stock`, with a 95% bootstrap interval; the median time the loop spent
freeing one kept batch, pushed out one at a time (`kept`) and 32 at once
(`kept, freed in bulk`); and, after a wait for the device, the time a batch
takes freed with `--keep` others at once.

Usage:
    python3 benchmarks/bench_device_arrays.py [--steps 400] [--keep 65] [--rounds 15] [--json PATH]
"""

import argparse
import collections
import json
import os
import queue
import statistics
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import median_interval  # noqa: E402
from _timing import no_collection  # noqa: E402

MODES = (
    "stock",
    "kept",
    "kept, freed in bulk",
    "kept, freed in a thread",
    "kept on the host",
    "one more output",
)
FEATURES, OUTPUTS, BATCH = 64, 10, 64
BULK = 32  # the batches `kept, freed in bulk` frees at once (the detector's default check_every)


def _step_body(w, x, y):
    error = x @ w - y
    return w - 1e-3 * (x.T @ error) / x.shape[0], jnp.mean(error * error)


def _step_body_with_record(w, record, x, y):
    w, loss = _step_body(w, x, y)
    record = record.at[0].add(1)
    return w, record, loss, record


_step = jax.jit(_step_body, donate_argnums=0)
_step_with_record = jax.jit(_step_body_with_record, donate_argnums=(0, 1))


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(BATCH, FEATURES)).astype("float32"),
            rng.normal(size=(BATCH, OUTPUTS)).astype("float32"),
        )
        for _ in range(steps)
    ]


def _one_ahead(batches):
    """`(host batch, placed batch)`: each batch placed on the device one step
    ahead, as Keras's JAX iterator does off a CPU."""
    following = None
    for batch in batches:
        placed = batch, tuple(jax.device_put(array) for array in batch)
        if following is not None:
            yield following
        following = placed
    if following is not None:
        yield following


class _Dropper:
    """A thread that drops what it is handed (the arrays are freed there)."""

    def __init__(self):
        self.queue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.queue.get() is not None:
            pass

    def close(self):
        self.queue.put(None)
        self.thread.join(timeout=60)


def run_mode(mode, batches, keep, dropper):
    """One round of `mode`: `(seconds a step, {"one": [...], "bulk": [...]}, freed)`:
    the seconds each kept batch took to free, one at a time or in bulk, and
    the kept batches freed in the round."""
    w = jnp.zeros((FEATURES, OUTPUTS), "float32")
    record = jnp.zeros((6,), "int32")
    kept = collections.deque(maxlen=keep if mode in ("kept", "kept on the host") else None)
    freeing = {"one": [], "bulk": []}
    freed = 0
    latest = None
    with no_collection():
        start = time.perf_counter()
        for host, batch in _one_ahead(batches):
            if mode == "one more output":
                w, record, loss, latest = _step_with_record(w, record, *batch)
            else:
                w, loss = _step(w, *batch)
            if mode == "kept":
                began = time.perf_counter()
                full = len(kept) == keep
                kept.append(batch)
                del batch
                if full:
                    freeing["one"].append(time.perf_counter() - began)
                    freed += 1
            elif mode == "kept, freed in bulk":
                kept.append(batch)
                del batch
                if len(kept) >= keep + BULK:
                    began = time.perf_counter()
                    oldest = [kept.popleft() for _ in range(BULK)]
                    oldest.clear()
                    freeing["bulk"].append((time.perf_counter() - began) / BULK)
                    freed += BULK
            elif mode == "kept on the host":
                freed += len(kept) == keep
                kept.append(host)
            elif mode == "kept, freed in a thread":
                if len(kept) == keep:
                    dropper.queue.put(kept.popleft())
                    freed += 1
                kept.append(batch)
        jax.block_until_ready((w, loss))
        seconds = time.perf_counter() - start
    del latest
    return seconds / len(batches), freeing, freed


def bulk_free(batches, keep):
    """Seconds per batch to free `keep` batches at once, after a wait for the device."""
    placed = [tuple(jax.device_put(array) for array in batch) for batch in batches[:keep]]
    jax.block_until_ready(placed)
    with no_collection():
        start = time.perf_counter()
        placed.clear()
        return (time.perf_counter() - start) / keep


def bench(steps, keep, rounds):
    batches = _batches(steps)
    dropper = _Dropper()
    try:
        for mode in MODES:
            run_mode(mode, batches, keep, dropper)  # warm-up: compiles
        times = {mode: [] for mode in MODES}
        freed_per_round = {}
        freeing = {"one": [], "bulk": []}
        for round_ in range(rounds):
            shift = round_ % len(MODES)
            order = MODES[shift:] + MODES[:shift]
            seconds = {mode: [] for mode in MODES}
            for mode in order + order[::-1]:
                step, timed, freed_per_round[mode] = run_mode(mode, batches, keep, dropper)
                seconds[mode].append(step)
                for how, each in timed.items():
                    freeing[how].extend(each)
            for mode in MODES:
                times[mode].append(statistics.fmean(seconds[mode]))
        bulk = [bulk_free(batches, keep) for _ in range(rounds)]
    finally:
        dropper.close()
    stock = times["stock"]
    modes = {}
    for mode in MODES:
        ratios = [t / s for t, s in zip(times[mode], stock)]
        modes[mode] = {
            "step_us": 1e6 * statistics.median(times[mode]),
            "ratio_to_stock": statistics.median(ratios),
            "ratio_interval": median_interval(ratios),
            "per_step_us_over_stock": 1e6 * (statistics.median(times[mode]) - statistics.median(stock)),
            "kept_batches_freed_per_round": freed_per_round[mode],
        }
    device = jax.devices()[0]
    return {
        "device": f"{device.device_kind} ({device.platform})",
        "versions": {"jax": jax.__version__},
        "steps": steps,
        "keep": keep,
        "rounds": rounds,
        "modes": modes,
        "freed_one_at_a_time_us_per_batch": _median_us(freeing["one"]),
        "freed_in_bulk_in_loop_us_per_batch": _median_us(freeing["bulk"]),
        "freed_after_wait_us_per_batch": 1e6 * statistics.median(bulk),
    }


def _median_us(seconds):
    return 1e6 * statistics.median(seconds) if seconds else None


def table(report):
    lines = [
        f"device: {report['device']}; {report['steps']} steps a round, {report['keep']} batches "
        f"kept, {report['rounds']} rounds (each forward and backward); medians",
        f"{'mode':<26} {'step':>10} {'ratio to stock (95%)':>26} {'per step':>10}",
    ]
    for mode, row in report["modes"].items():
        low, high = row["ratio_interval"]
        lines.append(
            f"{mode:<26} {row['step_us']:>8.1f}µs {row['ratio_to_stock']:>8.3f} "
            f"({low:.3f}-{high:.3f})    {row['per_step_us_over_stock']:>+8.1f}µs"
        )
    freed = [
        (report["freed_one_at_a_time_us_per_batch"], "pushed out by a step"),
        (report["freed_in_bulk_in_loop_us_per_batch"], f"{BULK} at once between steps"),
        (report["freed_after_wait_us_per_batch"], f"{report['keep']} at once after a wait"),
    ]
    lines.append(
        "a kept batch freed: "
        + ", ".join(f"{us:.1f} µs {how}" for us, how in freed if us is not None)
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--keep", type=int, default=65)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.keep < 1 or args.rounds < 1 or args.keep >= args.steps:
        parser.error(
            "--steps must be >= 2, --keep >= 1 and below --steps, and --rounds >= 1. "
            f"Received: --steps {args.steps}, --keep {args.keep}, --rounds {args.rounds}"
        )
    report = bench(args.steps, args.keep, args.rounds)
    print(table(report))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
