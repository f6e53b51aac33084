"""TensorFlow's private APIs for the tf.distribute checks, imported when a check first runs.

The audits run on both backends; on JAX the tf.distribute checks never run, so
TensorFlow's compatibility module (`backend/tensorflow/_compat.py`) is loaded
on first use only (`core/_lazy.py`).
"""

from keras_safe_dist.core._lazy import CHECKS
from keras_safe_dist.core._lazy import LazyModule

__all__ = ["compat"]

compat = LazyModule("keras_safe_dist.backend.tensorflow._compat", CHECKS, "tensorflow")
