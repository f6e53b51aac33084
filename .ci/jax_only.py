"""Checks that CI's JAX-only environment is what a JAX user has: no TensorFlow installed.

Prints the versions it holds; exits non-zero when TensorFlow can be imported
there or when `import keras_safe_dist` (on JAX) imported it.
"""

import importlib.metadata
import importlib.util
import os
import sys

if importlib.util.find_spec("tensorflow") is not None:
    sys.exit("The JAX-only environment has TensorFlow installed; it must not.")
os.environ["KERAS_BACKEND"] = "jax"
import keras_safe_dist  # noqa: E402, F401 - the import is the check

if "tensorflow" in sys.modules:
    sys.exit("import keras_safe_dist imported TensorFlow on JAX.")
versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("jax", "keras", "tensorboard"))
print(f"JAX only: Python {sys.version.split()[0]}, {versions}, no TensorFlow")
