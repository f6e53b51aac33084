"""Starting this process's part of a multi-process JAX run, with every wait bounded.

`keras_safe_dist.initialize()` (keras_safe_dist/scale_out/distributed.py) lands here on
JAX. It does what `keras.distribution.initialize()` does (join
`jax.distributed`, agree on Keras's random seed) with jax's timeouts set to
one bound instead of its defaults (300 s to start, 100 s to notice a dead
process, 300 s to shut down), chooses gloo collectives for CPU devices, and
starts the watchdog (`_watchdog.py`) that ends this process when another one
fails.
"""

import errno
import os
import socket
import sys
import threading
import time
import zlib

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_safe_dist.backend.jax import _compat as _jax_compat
from keras_safe_dist.backend.jax import _watchdog

# Keras's own variables (keras.distribution.initialize reads the same).
ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
COUNT = "KERAS_DISTRIBUTION_NUM_PROCESSES"
INDEX = "KERAS_DISTRIBUTION_PROCESS_ID"
# jax's own bound on joining, beyond ours: its C++ abort must never come first.
_JAX_GRACE = 30


def initialize(coordinator_address=None, num_processes=None, process_id=None, timeout=60):
    """Joins `jax.distributed`; see `keras_safe_dist.initialize`."""
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "keras_safe_dist.initialize() was called twice in this process (or after "
            f"jax.distributed.initialize()): it already runs as process {jax.process_index()} "
            f"of {jax.process_count()}. Call it once, first thing in the script."
        )
    coordinator_address = coordinator_address or _coordinator(os.environ.get(ADDRESSES))
    _check_port(coordinator_address)
    num_processes = _integer("num_processes", num_processes, COUNT)
    process_id = _integer("process_id", process_id, INDEX)
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(
            f"`process_id` must be in [0, num_processes - 1] = [0, {num_processes - 1}]. "
            f"Received: process_id={process_id}, num_processes={num_processes}"
        )
    _claim_process_id(coordinator_address, process_id, num_processes)
    if coordinator_address and process_id:
        _wait_for_coordinator(coordinator_address, process_id, timeout)
    elif coordinator_address and process_id == 0:
        _check_port_free(coordinator_address)
    if num_processes is not None:
        # jax ends a process that cannot register in time from C++, with no
        # Python exception: this line says what it was waiting for.
        print(
            f"keras_safe_dist: process {process_id} joining a run of {num_processes} "
            f"processes at {coordinator_address} (waiting up to {timeout} s for all of them)",
            file=sys.stderr,
            flush=True,
        )
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        # jax has no collectives between CPU devices of different processes
        # by default; accelerators keep their own (NCCL, ICI).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax's preemption service takes SIGTERM and lets training run on, for
    # code that checks `multihost_utils.reached_preemption_sync_point`, which
    # Keras's fit() does not: a SIGTERM would be lost. Off, SIGTERM ends the
    # process, and the watchdog ends the others naming it.
    jax.config.update("jax_enable_preemption_service", False)
    joined = _bounded_join(coordinator_address, num_processes, process_id, timeout)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout + _JAX_GRACE,
            heartbeat_timeout_seconds=timeout,
            shutdown_timeout_seconds=timeout,
        )
    except Exception as error:
        if coordinator_address is None and "coordinator_address" in str(error):
            # Nothing named a coordinator, and jax found no cluster (Slurm, MPI, a TPU pod).
            raise ValueError(
                "keras_safe_dist.initialize() found no coordinator: the script ran "
                f"without {ADDRESSES}, {COUNT} and {INDEX}, no arguments, and jax detected "
                "no cluster (Slurm, Open MPI, a Cloud TPU). Start it with `keras-safe-dist "
                "launch --backend jax --workers N script.py`, set those three variables "
                "for each process, or pass coordinator_address, num_processes and "
                f"process_id. jax said: {error}"
            ) from error
        raise RuntimeError(
            f"This process (process_id={process_id}) could not join the run within "
            f"{timeout} s: coordinator {coordinator_address!r}, {num_processes} processes. "
            "Check that every process was started with the same coordinator address "
            "and process count, each with its own process_id, and that process 0 "
            f"(the coordinator) is running. jax said: {error}"
        ) from error
    finally:
        joined.set()
    _jax_compat.initialize_rng()
    _watchdog.start(timeout)
    return jax.process_index(), jax.process_count()


def _claim_process_id(address, process_id, num_processes):
    """Refuses a second process of one run with one process id on this machine.

    Each process binds a Unix socket in Linux's abstract namespace, named
    after the run's coordinator address and its process id: the kernel
    refuses a second bind of the name and drops it when the process ends,
    however it ends, and nothing is written to disk. jax would make both
    processes wait, then abort every process from C++. Elsewhere than on
    Linux, jax's bound applies (see `_bounded_join`).
    """
    if not address or process_id is None or not sys.platform.startswith("linux"):
        return
    name = f"\0keras_safe_dist-run-{zlib.crc32(address.encode()):08x}-process-{process_id}"
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(name)
    except OSError as error:
        claim.close()
        if error.errno != errno.EADDRINUSE:
            return
        count = "" if num_processes is None else f" of {num_processes}"
        raise RuntimeError(
            f"Another process on this machine already joined the run at {address!r} as "
            f"process_id={process_id}{count}. Every process needs a process id of its own, "
            f"from 0 to the process count - 1 ({INDEX}): start this one with the id no "
            "other process has, or with `keras-safe-dist launch`, which numbers them."
        ) from None
    _CLAIMS.append(claim)  # held until this process ends


_CLAIMS = []


def _bounded_join(address, num_processes, process_id, timeout):
    """Ends this process, naming the cause, if jax has not joined every process in `timeout` s.

    jax's `initialize` waits in C++ for every process to register and then
    aborts the process (a check failure, no Python exception): a process
    count above the processes started, or a process id that another process
    took, ends so. No Python exception can interrupt that wait: a thread
    prints the reason and exits with status 1 first (jax's own bound is
    `_JAX_GRACE` s later).

    Returns:
        The event to set once jax joined (or raised).
    """
    joined = threading.Event()

    def watch():
        if joined.wait(timeout):
            return
        print(
            f"keras_safe_dist: process {process_id} could not join the run at {address!r} "
            f"within {timeout} s: not all of its {num_processes} processes registered. Start "
            f"exactly {num_processes} processes ({COUNT}), each with its own process id from "
            f"0 to {(num_processes or 1) - 1} ({INDEX}) and the same coordinator address: a "
            "process count above the processes started, or two processes with one process "
            "id (on different machines), end so. Exit status 1.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)

    threading.Thread(target=watch, name="keras_safe_dist join bound", daemon=True).start()
    return joined


def _wait_for_coordinator(address, process_id, timeout):
    """Returns once process 0's coordination service accepts connections; raises after `timeout` s."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
                return
        except (OSError, ValueError) as error:
            if time.monotonic() > deadline or isinstance(error, ValueError):
                raise RuntimeError(
                    f"Process {process_id} could not reach the coordinator (process 0) at "
                    f"{address!r} within {timeout} s ({error}). Start process 0 with the "
                    "same address, or correct KERAS_DISTRIBUTION_JOB_ADDRESSES (its first "
                    "address is process 0's)."
                ) from error
            time.sleep(0.5)


def _check_port(address):
    """Refuses a coordinator address whose port no process can reach (0, not a number)."""
    if not address:
        return
    _, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            "The coordinator address must be 'host:port' with a port from 1 to 65535, "
            f"the port process 0 listens on. Received: {address!r}. Give a free port of "
            "process 0's host (keras-safe-dist launch picks one)."
        )


def _check_port_free(address):
    """On process 0: refuses a coordinator port that another program holds.

    jax would fail to start its coordination service there ("Failed to start
    RPC server") or crash the process.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("" if family == socket.AF_INET else "::", int(port)))
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            return  # not ours to judge (a host name of another machine, say)
        raise RuntimeError(
            f"Process 0 cannot host the coordinator at {address!r}: port {port} is in use "
            "by another program. Choose a free port for the first address of "
            "KERAS_DISTRIBUTION_JOB_ADDRESSES (or coordinator_address), or stop the "
            "program that holds it."
        ) from None


def _coordinator(addresses):
    if not addresses:
        return None
    return addresses.split(",")[0].strip()


def _integer(name, value, variable):
    source = f"{name}={value!r}"
    if value is None:
        value = os.environ.get(variable)
        if value is None:
            return None
        source = f"{variable}={value!r}"
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < 0 or isinstance(value, bool):
        raise ValueError(f"`{name}` must be an integer >= 0. Received: {source}")
    return number


def check_joined(where):
    """Refuses `where` (`"fit"`, ...) where the processes would each train alone.

    - This process was started as one of several (Keras's
      `KERAS_DISTRIBUTION_NUM_PROCESSES` above 1, as `keras-safe-dist launch`
      sets it), but jax runs it alone: `initialize()` was not called, and
      every process would train on the same rows, unaware of the others.
    - Several processes joined, but no `keras.distribution` spans their
      devices: each process would fit its own model on its own rows.

    Raises:
        RuntimeError: in the first case; ValueError: in the second.
    """
    count = jax.process_count()
    wanted = os.environ.get(COUNT, "").strip()
    if count == 1:
        if wanted.isdigit() and int(wanted) > 1:
            raise RuntimeError(
                f"{where}() runs in one process, but this process was started as one of "
                f"{wanted} ({COUNT}={wanted}, {INDEX}={os.environ.get(INDEX)!r}): jax "
                "was never told of the others, so each process would train alone on the "
                "same data. Call keras_safe_dist.initialize() first thing in the script, "
                "before building the model."
            )
        return
    distribution = keras.distribution.distribution()
    processes = set()
    if distribution is not None:
        processes = {d.process_index for d in _mesh_devices(distribution)}
    if len(processes) < count:
        received = (
            "no distribution" if distribution is None
            else f"{type(distribution).__name__} over the devices of "
            f"{len(processes)} of them"
        )
        raise ValueError(
            f"{where}() with {count} processes needs a keras.distribution over the "
            f"devices of every process; received: {received}. Without one each process "
            f"would {'fit its own model' if where == 'fit' else 'run alone'} on its own "
            "rows. Call keras.distribution.set_distribution("
            "keras.distribution.DataParallel()) after keras_safe_dist.initialize() and "
            "before building the model."
        )


def _mesh_devices(distribution):
    mesh = getattr(distribution, "device_mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is None:
        return []
    return [d for d in getattr(devices, "flat", devices)]


# `where` of check_same_call, as numbers every process exchanges.
_CALLS = ("fit", "evaluate", "predict")


def check_same_call(where, model, epochs=0):
    """With several processes: refuses to start a call the processes do not all make alike.

    Every process exchanges what it is about to run (the method, the
    epochs, its model's trainable variables: count, sizes, shapes) before
    its first step. Processes that differ would otherwise meet in different
    collectives, which gloo ends with SIGABRT ("collective mismatch") after
    10 to 20 s.

    Raises:
        ValueError: on every process, naming what each runs.
    """
    if jax.process_count() == 1:
        return
    # Counted for a process that ends its script early (see `_watchdog`).
    _watchdog.entering(where)
    variables = list(model.trainable_variables)
    shapes = "|".join(f"{v.path}:{tuple(v.shape)}" for v in variables)
    mine = [
        _CALLS.index(where),
        int(epochs),
        len(variables),
        sum(int(np.prod(v.shape)) for v in variables) % 2**31,
        zlib.crc32(shapes.encode()) % 2**31,
    ]
    everyone = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.int32)))
    if (everyone == everyone[0]).all():
        return
    described = "; ".join(
        f"process {i}: {_CALLS[row[0]]}()"
        + (f" for {row[1]} epochs" if _CALLS[row[0]] == "fit" else "")
        + f" of a model of {row[2]} trainable variables, {row[3]} values"
        for i, row in enumerate(everyone.tolist())
    )
    if len({tuple(row[:4]) for row in everyone.tolist()}) == 1:
        described += " (the variables' names or shapes differ)"
    raise ValueError(
        f"The {len(everyone)} processes do not run the same program: {described}. Every "
        "process must call the same methods with the same epochs on the same model (only "
        "its data may differ). Start every process with the same script and arguments."
    )
