"""JAX's trainer for `SafeDistributedModel`.

Importing any part of it first checks the installed keras: the JAX step needs
the keras the JAX suite runs with (the `jax` extra's floor in setup.cfg), and
an older one fails in it with errors that name no fix (docs/versions.md).
"""

import re

import keras

# The `jax` extra's keras floor in setup.cfg; tests/test_declared_versions.py
# checks that the two agree.
KERAS_FLOOR = (3, 15)


def check_keras_version(version):
    """Refuses, with the fix, a keras older than `KERAS_FLOOR` on the JAX backend.

    Args:
        version: keras's version string, as `keras.__version__` gives it.

    Raises:
        ImportError: `version` is older than `KERAS_FLOOR`.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) >= KERAS_FLOOR:
        return
    floor = ".".join(map(str, KERAS_FLOOR))
    raise ImportError(
        f"keras_safe_dist on Keras's JAX backend needs keras >= {floor}; "
        f"keras {version} is installed. With an older keras its JAX step fails "
        "(docs/versions.md lists how). Install the JAX extra, which brings a keras "
        'it runs with: pip install "keras-safe-dist[jax]", or use the TensorFlow '
        "backend (KERAS_BACKEND=tensorflow), which runs from keras 3.10."
    )


check_keras_version(keras.__version__)
