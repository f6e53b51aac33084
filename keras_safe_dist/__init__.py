"""keras_safe_dist: correct, observable data-parallel Keras training on TensorFlow."""

from keras_safe_dist.model import SafeDistributedFunctional
from keras_safe_dist.model import SafeDistributedModel

__version__ = "0.1.0"

__all__ = [
    "SafeDistributedFunctional",
    "SafeDistributedModel",
    "__version__",
]
