"""Start a script as several local workers: TensorFlow's or JAX's processes.

With `backend="tensorflow"` each worker gets a `TF_CONFIG` for
MultiWorkerMirroredStrategy; with `backend="jax"`, Keras's
`KERAS_DISTRIBUTION_*` variables for `jax.distributed` (see `jax_env`).
For local runs and tests: the workers find each other at 127.0.0.1. Note that
TensorFlow's gRPC worker service binds every network interface (`*:port`,
IPv4 and IPv6) without authentication, whatever address `TF_CONFIG` names,
and offers no option to bind one, and that JAX's coordinator (process 0)
binds `[::]:port` too unless `JAX_COORDINATOR_BIND_ADDRESS` says otherwise:
run them behind a firewall or on a private network. On a real cluster, give
each machine its own `TF_CONFIG` or `KERAS_DISTRIBUTION_*` variables (see
docs/scaling_out.md).

Workers end with the launcher however it ends: on a failure, a timeout or a
signal it kills their process groups itself; if it is killed outright
(SIGKILL, the out-of-memory killer), a small watcher process (`_reaper.py`)
sees the launcher's end of a pipe close and kills them.

This module imports neither TensorFlow nor Keras.
"""

import contextlib
import signal
import sys
import threading
import time

from keras_safe_dist.scale_out._cluster import free_ports
from keras_safe_dist.scale_out._cluster import jax_env
from keras_safe_dist.scale_out._cluster import max_workers
from keras_safe_dist.scale_out._cluster import tf_config
from keras_safe_dist.scale_out._workers import BACKENDS
from keras_safe_dist.scale_out._workers import WorkerGroup

__all__ = [
    "BACKENDS", "WorkerGroup", "free_ports", "jax_env", "launch", "max_workers", "shell_status",
    "tf_config",
]

# Signals that end the launcher; its workers are killed first.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stopped(Exception):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def launch(script, workers=2, args=(), timeout=600, env=None, backend="tensorflow"):
    """Runs `script` as `workers` local workers and returns one exit status.

    SIGINT (Ctrl-C), SIGTERM or SIGHUP to the launcher kill every worker's
    process group before it returns; if the launcher is killed outright,
    the workers' groups are killed by a watcher process. When a worker
    fails because another process took its port between the launcher
    choosing it and the worker binding it, the message names the port and
    every worker starts again, once, with fresh ports. Worker output is printed with a
    `[worker i]` prefix; what went wrong goes to stderr.

    Args:
        script: path of the Python script every worker runs; see
            `WorkerGroup`.
        workers: number of workers, integer >= 1.
        args: extra command-line arguments for the script.
        timeout: seconds to wait for all the workers before killing them.
        env: extra environment variables for every worker.
        backend: `"tensorflow"` or `"jax"`; see `WorkerGroup`.

    Returns:
        0 when every worker succeeded; else, as a shell reports it, the exit
        status of the first worker that failed (128 + N for one that signal N
        ended; the others are killed), 124 when the timeout killed them, or
        128 + N when the launcher got signal N.

    Raises:
        ValueError: when `workers` is not an integer >= 1 or more than this
            machine can run (see `max_workers`), or `script` is None.
        FileNotFoundError: when `script` is not a file.

    Example:

    ```python
    from keras_safe_dist.scale_out.launch import launch

    sys.exit(launch("train.py", workers=2, args=["--epochs", "3"], timeout=600))
    ```
    """
    deadline = time.monotonic() + timeout
    for attempt in (1, 2):
        group = WorkerGroup(script, workers=workers, args=args, env=env, backend=backend)
        with _stop_on_signals():
            try:
                group.start()
                codes = group.wait(max(deadline - time.monotonic(), 1))
            except TimeoutError as error:
                print(f"keras-safe-dist launch: {error}", file=sys.stderr)
                return 124
            except _Stopped as stopped:
                group.kill()
                name = signal.Signals(stopped.signum).name
                print(f"keras-safe-dist launch: got {name}; killed the workers.", file=sys.stderr)
                return 128 + stopped.signum
            finally:
                group.kill()
        taken = group.taken_port()
        if taken is None:
            break
        index, port = taken
        what = (
            f"keras-safe-dist launch: worker {index} could not bind port {port} on "
            "127.0.0.1: another process took it between the launcher choosing it "
            "and the worker binding it"
        )
        if attempt == 1:
            print(f"{what}; starting every worker again with fresh ports.", file=sys.stderr)
        else:
            print(f"{what}, on the second try too; giving up.", file=sys.stderr)
    if group.first_failure is not None:
        index, code = group.first_failure
        print(
            f"keras-safe-dist launch: worker {index} {_ended(code)}; "
            "killed the other workers.",
            file=sys.stderr,
        )
        return shell_status(code)
    failed = [code for code in codes if code != 0]
    return shell_status(failed[0]) if failed else 0


def shell_status(code):
    """A `Popen.returncode` as a shell reports it: -N (signal N) becomes 128 + N.

    Args:
        code: a process's return code.

    Returns:
        The exit status a shell would show, an int.

    Example:

    ```python
    shell_status(-9)  # 137: killed by SIGKILL
    shell_status(3)  # 3
    ```
    """
    return 128 - code if code < 0 else code


def _ended(code):
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


@contextlib.contextmanager
def _stop_on_signals():
    """Turns the stop signals into `_Stopped` (only the main thread can handle signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
