"""What the benchmarks share: timed regions free of garbage collection, and
workers in subprocesses."""

import contextlib
import gc
import json
import subprocess
import sys


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


def run_worker(script, arguments, what):
    """Runs `script` with `arguments` in a new Python process; returns the JSON
    it prints on its last line of output.

    Raises:
        RuntimeError: when the worker fails, with the end of its stderr.
    """
    command = [sys.executable, script, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"The {what} worker failed with exit code {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])
