"""On the JAX backend keras_safe_dist refuses, with the fix, a keras older than the `jax` extra's floor.

At keras 3.10 its JAX step fails 27 of the JAX suite's tests with errors that
name no fix (docs/versions.md); the import says what to install instead.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from keras_safe_dist.backend import jax as jax_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["3.10.0", "3.14.1", "2.15.0"])
def test_an_older_keras_is_refused_with_what_to_install(version):
    with pytest.raises(ImportError) as raised:
        jax_backend.check_keras_version(version)
    message = str(raised.value)
    assert "needs keras >= 3.15" in message
    assert f"keras {version} is installed" in message
    assert 'pip install "keras-safe-dist[jax]"' in message
    assert "KERAS_BACKEND=tensorflow" in message


@pytest.mark.parametrize("version", ["3.15.0", "3.15.1", "3.16.0.dev2026112800", "4.0.0"])
def test_the_floor_and_newer_releases_pass(version):
    assert jax_backend.check_keras_version(version) is None


def test_importing_the_package_with_an_older_keras_fails_before_any_step():
    # A process of its own: the package is imported once per process.
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    script = "import keras\nkeras.__version__ = '3.12.4'\nimport keras_safe_dist\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: keras_safe_dist on Keras's JAX backend needs keras >= 3.15;")
    assert "keras 3.12.4 is installed" in last_line
