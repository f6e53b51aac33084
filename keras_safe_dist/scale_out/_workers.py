"""Local worker processes of one cluster, started and stopped together (`WorkerGroup`).

`launch.launch` runs a script through it and turns its result into one exit
status. Each worker gets its cluster's `TF_CONFIG` or `KERAS_DISTRIBUTION_*`
variables (`_cluster.py`), runs in its own process group, and is watched by
`_reaper.py`, which kills the groups if the launcher is killed outright.

This module imports neither TensorFlow nor Keras.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

from keras_safe_dist.scale_out import _cluster
from keras_safe_dist.scale_out import _reaper

__all__ = ["BACKENDS", "WorkerGroup"]

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
        most, reason = _cluster.max_workers()
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
        ports = self.ports = _cluster.free_ports(self.workers)
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
                cluster = _cluster.jax_env(ports, index)
            else:
                cluster = {"TF_CONFIG": _cluster.tf_config(ports, index)}
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
            if index in self._bind_failed or _cluster.port_in_use(self.ports[index]):
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


_print_lock = threading.Lock()


def _print_line(index, line):
    with _print_lock:
        print(f"[worker {index}] {line}", flush=True)
