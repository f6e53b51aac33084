"""The cluster of local workers: free ports on 127.0.0.1, how many workers fit, each one's environment.

TensorFlow's workers find each other through `TF_CONFIG` (`tf_config`), JAX's
processes through Keras's `KERAS_DISTRIBUTION_*` variables (`jax_env`). This
module imports neither TensorFlow nor Keras.
"""

import os
import socket

from keras_safe_dist.core import _json

# Files the launcher may open besides one per worker (its reader threads,
# Popen's own pipes, the watcher's pipe).
_SPARE_FILES = 32

def max_workers():
    """The most local workers this process can start, and what limits them.

    Each worker holds a TCP port on 127.0.0.1 (the kernel hands out those of
    its ephemeral range) and an open file in the launcher (its output pipe;
    a socket while the ports are chosen).

    Returns:
        `(count, reason)`: an int, and a str saying what limits it.

    Example:

    ```python
    count, reason = max_workers()  # e.g. (19953, "this process may open 20000 files ...")
    ```
    """
    ports = _ephemeral_ports()
    limits = [(ports, f"the kernel hands out {ports} ports on 127.0.0.1 and each worker needs one")]
    try:
        import resource
    except ImportError:  # not on POSIX
        return limits[0]
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files != resource.RLIM_INFINITY:
        used = _open_files()
        limits.append((
            max(files - used - _SPARE_FILES, 0),
            f"this process may open {files} files (ulimit -n), {used} are open, and "
            "each worker needs one (its output pipe) besides a few for the launcher",
        ))
    return min(limits)


def _ephemeral_ports():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(n) for n in f.read().split())
        return high - low + 1
    except (OSError, ValueError):
        return 65535 - 49152 + 1  # the IANA range


def _open_files():
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def port_in_use(port):
    """Whether another socket holds `port` on 127.0.0.1 (binding it fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def free_ports(count):
    """`count` distinct TCP ports that are free on 127.0.0.1 right now.

    The ports are found by binding `count` sockets at once, then closing
    them: another process may take one before the caller binds it.

    Args:
        count: how many ports.

    Returns:
        A list of `count` distinct port numbers (int).

    Raises:
        OSError: when a socket cannot be created or bound on 127.0.0.1
            (e.g. no IPv4 on the machine).

    Example:

    ```python
    ports = free_ports(2)  # e.g. [41377, 35521]
    ```
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def jax_env(ports, index):
    """The environment of process `index` among local JAX processes.

    Keras's own variables, which `keras.distribution.initialize()` and
    `keras_safe_dist.initialize()` read: the coordinator is process 0 at
    127.0.0.1. CPU devices exchange data over gloo (jax has no CPU
    collectives by default); accelerators keep their own.

    Args:
        ports: one port per process; process 0's is the coordinator's.
        index: this process's index.

    Returns:
        A dict of environment variables.

    Example:

    ```python
    jax_env([12345, 12346], index=1)
    # {"KERAS_BACKEND": "jax",
    #  "KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:12345,127.0.0.1:12346",
    #  "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": "1",
    #  "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
    ```
    """
    return {
        "KERAS_BACKEND": "jax",
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": ",".join(f"127.0.0.1:{port}" for port in ports),
        "KERAS_DISTRIBUTION_NUM_PROCESSES": str(len(ports)),
        "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }


def tf_config(ports, index):
    """The `TF_CONFIG` of worker `index` in a cluster of local workers.

    Args:
        ports: one port per worker; worker `i` listens at
            `127.0.0.1:ports[i]`.
        index: this worker's index in `ports`.

    Returns:
        The JSON text for the `TF_CONFIG` environment variable.

    Example:

    ```python
    os.environ["TF_CONFIG"] = tf_config([12345, 12346], index=1)
    # {"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]},
    #  "task": {"type": "worker", "index": 1}}
    ```
    """
    return _json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
            "task": {"type": "worker", "index": index},
        }
    )
