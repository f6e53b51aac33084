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
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

from keras_safe_dist.scale_out import _reaper
from keras_safe_dist.scale_out._cluster import free_ports
from keras_safe_dist.scale_out._cluster import jax_env
from keras_safe_dist.scale_out._cluster import max_workers
from keras_safe_dist.scale_out._cluster import port_in_use
from keras_safe_dist.scale_out._cluster import tf_config

__all__ = [
    "BACKENDS", "WorkerGroup", "free_ports", "jax_env", "launch", "max_workers", "shell_status",
    "tf_config",
]

_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")

# What a worker prints when its port was taken: TensorFlow's gRPC server, or
# the errno text of a plain bind.
# TensorFlow's worker server failing to start: on the port the launcher chose.
_SERVER_FAILED = "Could not start gRPC server"
# Any server's bind failure: the launcher's port only when the line names it.
_ADDRESS_IN_USE = "Address already in use"


def _bind_failure(text, port):
    """Whether a worker's output line says it could not bind `port`, the launcher's choice.

    A worker's own server (say on port 8500) failing to bind is the worker's
    failure, not the launcher's: starting every worker again would not help.
    """
    if _SERVER_FAILED in text:
        return True
    return _ADDRESS_IN_USE in text and re.search(rf"(?<!\d){port}(?!\d)", text) is not None


BACKENDS = ("tensorflow", "jax")


class WorkerGroup:
    """Local worker processes of one cluster, started and stopped together.

    Each worker runs `python script *args` (or `python -m module *args`) with
    its own `TF_CONFIG` (TensorFlow) or Keras's `KERAS_DISTRIBUTION_*`
    variables (JAX, see `jax_env`), in its own process group, which `kill()` ends with
    every process the worker started. Output lines are passed to
    `on_line(index, line)`, which by default prints them with a `[worker i]`
    prefix; bytes that are not UTF-8 become replacement characters.

    Args:
        script: path of the Python script every worker runs. It must create
            its `MultiWorkerMirroredStrategy` before any other TensorFlow op.
            None when `module` is given.
        workers: number of workers, integer >= 1.
        args: extra command-line arguments for the script.
        env: extra environment variables for every worker.
        on_line: called with (worker index, output line without newline).
        module: name of a module every worker runs with `python -m`, instead
            of `script`.
        backend: `"tensorflow"` (a `TF_CONFIG` per worker) or `"jax"`
            (Keras's variables for `jax.distributed`).

    While the group runs, a watcher process kills every worker's group if
    the launcher dies without stopping them (killed with SIGKILL, say).

    Raises:
        ValueError: when `workers` is not an integer >= 1 or more than this
            machine can run (see `max_workers`; checked before any port is
            bound), not exactly one of `script` and `module` is given, or
            `backend` is not one of `BACKENDS`.
        FileNotFoundError: when `script` is not a file.

    Example:

    ```python
    group = WorkerGroup("train.py", workers=2, args=["--epochs", "3"]).start()
    codes = group.wait(timeout=600)  # [0, 0] when both workers succeeded
    ```
    """

    def __init__(
        self, script, workers=2, args=(), env=None, on_line=None, module=None, backend="tensorflow"
    ):
        if backend not in BACKENDS:
            raise ValueError(
                f"`backend` must be one of {', '.join(map(repr, BACKENDS))}. "
                f"Received: backend={backend!r}"
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(
                f"`workers` must be an integer >= 1. Received: workers={workers!r}"
            )
        most, reason = max_workers()
        if workers > most:
            raise ValueError(
                f"`workers` must be at most {most} on this machine: {reason}. "
                f"Received: workers={workers}. Start fewer workers"
                + (", or raise the limit (ulimit -n)." if "ulimit" in reason else ".")
            )
        if (script is None) == (module is None):
            raise ValueError(
                "Pass exactly one of `script` and `module`. "
                f"Received: script={script!r}, module={module!r}"
            )
        if script is not None and not os.path.isfile(script):
            raise FileNotFoundError(
                f"No script to launch at {script!r}. Pass the path of a Python file."
            )
        self.script = script
        self.module = module
        self.backend = backend
        self.workers = workers
        self.args = [str(a) for a in args]
        self.env = dict(env or {})
        self.on_line = on_line or _print_line
        self.processes = []
        self.ports = []
        self.first_failure = None  # (worker index, exit code) of the first to fail
        self._readers = []
        self._bind_failed = set()  # workers that printed a bind failure
        self._reaper = None
        self._reaper_lock = threading.Lock()
        # In every worker's environment, so that clean-up finds the workers'
        # descendants that left their process group (a new session, a daemon).
        self.launch_id = uuid.uuid4().hex

    def start(self):
        """Starts every worker, each with its own `TF_CONFIG` (or JAX variables) on a free port.

        Returns:
            This group, so that `WorkerGroup(...).start()` can be assigned.

        Raises:
            OSError: when no free port can be found (see `free_ports`).
        """
        ports = self.ports = free_ports(self.workers)
        program = [self.script] if self.module is None else ["-m", self.module]
        # Its own session: Ctrl-C in a terminal reaches the launcher, not it.
        # Not the launcher's output either: a reader of it would wait for
        # the watcher's end.
        self._reaper = subprocess.Popen(
            [sys.executable, "-I", _REAPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._tell_reaper(f"mark {self.launch_id}")
        for index in range(self.workers):
            if self.backend == "jax":
                cluster = jax_env(ports, index)
            else:
                cluster = {"TF_CONFIG": tf_config(ports, index)}
            env = dict(os.environ, **self.env, **cluster)
            env[_reaper.MARK] = self.launch_id
            env.setdefault("PYTHONUNBUFFERED", "1")
            process = subprocess.Popen(
                [sys.executable, *program, *self.args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._tell_reaper(f"add {process.pid}")
            reader = threading.Thread(
                target=self._read, args=(index, process), daemon=True
            )
            reader.start()
            self.processes.append(process)
            self._readers.append(reader)
        return self

    def _read(self, index, process):
        # Bytes, not text: one byte that is not UTF-8 must not end the reader,
        # or the pipe fills and the worker blocks.
        for line in process.stdout:
            text = line.decode("utf-8", errors="replace").rstrip("\r\n")
            if index < len(self.ports) and _bind_failure(text, self.ports[index]):
                self._bind_failed.add(index)
            self.on_line(index, text)

    def taken_port(self):
        """`(worker index, port)` of a failed worker whose port another process held, or None.

        A worker failed on its port when it printed a bind failure
        (TensorFlow's "Could not start gRPC server") or when the port is
        still held now that the worker is gone.
        """
        for index, process in enumerate(self.processes):
            if process.poll() in (None, 0) or index >= len(self.ports):
                continue
            if index in self._bind_failed or port_in_use(self.ports[index]):
                return index, self.ports[index]
        return None

    def _tell_reaper(self, line):
        with self._reaper_lock:
            if self._reaper is None:
                return
            try:
                self._reaper.stdin.write(f"{line}\n".encode())
                self._reaper.stdin.flush()
            except OSError:
                pass  # the watcher is gone; the launcher still cleans up itself

    def _stop_reaper(self):
        with self._reaper_lock:
            reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        try:
            reaper.stdin.write(b"done\n")
            reaper.stdin.close()
        except OSError:
            pass
        try:
            reaper.wait(timeout=5)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()

    def wait(self, timeout):
        """Waits for every worker; kills the group if one fails or time runs out.

        Whatever happens, no process of a worker's group outlives this call
        (a worker that exited may have left children behind). The first
        worker to fail is kept in `first_failure` as `(index, exit code)`.

        Args:
            timeout: seconds to wait for all the workers.

        Returns:
            The exit codes, one per worker; -N for a worker a signal N ended.

        Raises:
            TimeoutError: when the workers did not all finish within
                `timeout` seconds (they are killed first).
        """
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self.processes]
            if all(code is not None for code in codes):
                break
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                self.first_failure = failed[0]
                self.kill()
                break
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"Workers still running after {timeout} s; killed them. "
                    "A hung collective usually means one worker failed or "
                    "was started late."
                )
            time.sleep(0.1)
        self.kill()  # the children of workers that exited
        for reader in self._readers:
            reader.join(timeout=5)
        return [p.wait() for p in self.processes]

    def kill(self, index=None):
        """Kills one worker's process group, or all of them.

        A group outlives its worker while the worker's children run, so a
        worker that already exited has its group killed too. Returns once
        the killed workers have exited.

        Args:
            index: the worker whose group to kill; None kills every group.
        """
        chosen = self.processes if index is None else [self.processes[index]]
        for process in chosen:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone
        for process in chosen:
            process.wait()
            self._tell_reaper(f"forget {process.pid}")
        if index is None:
            # Descendants that left the groups (their own session) but kept
            # the environment they were given.
            _reaper.kill_marked(self.launch_id)
            self._stop_reaper()  # nothing left to watch


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


_print_lock = threading.Lock()


def _print_line(index, line):
    with _print_lock:
        print(f"[worker {index}] {line}", flush=True)
