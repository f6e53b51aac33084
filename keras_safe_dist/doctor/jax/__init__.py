"""`keras-safe-dist doctor --backend jax`: the probes that exist on Keras's JAX backend.

Keras reads the backend, and XLA the number of CPU devices, once per process,
so the JAX probes run in a process of their own: `run()` starts
`python -m keras_safe_dist.doctor.jax` with `KERAS_BACKEND=jax`,
`JAX_PLATFORMS=cpu` and `XLA_FLAGS=--xla_force_host_platform_device_count=N`,
and that process (`runner.py`) prints the same report as the TensorFlow
doctor. Nothing here imports Keras or JAX.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

__all__ = ["child_environment", "installed", "run"]

_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[3])
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def installed():
    """Whether jax can be imported."""
    return importlib.util.find_spec("jax") is not None


def child_environment(replicas, environ=None):
    """The environment of the JAX doctor's process: the JAX backend on `replicas` CPU devices."""
    env = dict(os.environ if environ is None else environ)
    flags = _DEVICE_COUNT.sub("", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={replicas}"])
    env["KERAS_BACKEND"] = "jax"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env


def run(replicas, as_json=False, only=None, verbose=False):
    """Runs the JAX probes in a child process sharing this one's stdout and stderr.

    Returns:
        The child's exit status: 0 when SafeDistributedModel passed every
        probe, 1 otherwise, 2 for bad arguments (an unknown probe name).
    """
    command = [sys.executable, "-m", "keras_safe_dist.doctor.jax", "--replicas", str(replicas)]
    command += ["--json"] * as_json + ["--verbose"] * verbose
    if only:
        command += ["--only", *only]
    sys.stdout.flush()
    return subprocess.run(command, env=child_environment(replicas)).returncode
