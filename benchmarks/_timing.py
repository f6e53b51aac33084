"""What the benchmarks share: timed regions free of garbage collection, and
workers in subprocesses."""

import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time


@contextlib.contextmanager
def no_collection():
    """No garbage collection inside a timed region.

    `fit()` leaves reference cycles that hold tf.data iterators, and freeing an
    old one waits for its background threads (seconds, up to a minute). The
    garbage of earlier runs is collected before the timer starts, and what
    survives is frozen, so that each collection stays short.
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def epoch_seconds(model, x, y, batch, wait=None, callbacks=None):
    """Seconds of one `fit()` epoch, unshuffled, without garbage collection.

    Args:
        wait: called with the model after `fit()` returns, inside the timed
            region, to wait for work that `fit()` leaves running (JAX
            dispatches asynchronously).
        callbacks: passed to `fit()`.
    """
    with no_collection():
        start = time.perf_counter()
        model.fit(
            x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=callbacks
        )
        if wait is not None:
            wait(model)
        return time.perf_counter() - start


def median_interval(values, resamples=2000, seed=0):
    """A 95% bootstrap interval of the median of `values`: `(low, high)`."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def interleave(
    configs, baseline, x, y, batch, rounds, wait=None, callbacks=None, balanced=False
):
    """Times `configs` (name: model) epoch by epoch in rotating order.

    `wait` is passed to `epoch_seconds`; `callbacks` (name: list of
    callbacks, for some of the names) to the `fit()` of those names.
    `balanced`: each round runs its rotation forward, then backward (A B B A),
    and takes each config's mean of the two, so that a cost tied to a
    position in the round (the first fit after another model's, a clock
    ramping up) falls on every config alike. Without it, a round count that
    the config count does not divide puts more rounds of one order into the
    median.

    Returns:
        name: median epoch seconds, median ratio to `baseline` with its 95%
        bootstrap interval, the fixed cost per step against it in
        microseconds, and each round's seconds (balanced: the mean of its two
        fits).
    """
    callbacks = callbacks or {}
    for name, model in configs.items():
        # warm-up: tracing and building
        epoch_seconds(model, x, y, batch, wait, callbacks.get(name))
    names = list(configs)
    times = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        order = names[shift:] + names[:shift]
        seconds = {name: [] for name in names}
        for name in order + (order[::-1] if balanced else []):
            seconds[name].append(
                epoch_seconds(configs[name], x, y, batch, wait, callbacks.get(name))
            )
        for name in names:
            times[name].append(statistics.fmean(seconds[name]))
    steps = -(-len(x) // batch)
    base = statistics.median(times[baseline])
    return {
        name: {
            "median_epoch_s": statistics.median(times[name]),
            "median_ratio": statistics.median(
                t / b for t, b in zip(times[name], times[baseline])
            ),
            "ratio_interval": median_interval(
                [t / b for t, b in zip(times[name], times[baseline])]
            ),
            "per_step_us": 1e6 * (statistics.median(times[name]) - base) / steps,
            "steps": steps,
            "epoch_s": times[name],
        }
        for name in names
    }


def run_worker(script, arguments, what, env=None):
    """Runs `script` with `arguments` in a new Python process; returns the JSON
    it prints on its last line of output.

    Args:
        env: variables to set in the worker's environment, beside this one's.

    Raises:
        RuntimeError: when the worker fails, with the end of its stderr.
    """
    command = [sys.executable, script, *arguments]
    environment = {**os.environ, **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    if done.returncode != 0:
        raise RuntimeError(
            f"The {what} worker failed with exit code {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])
