"""keras_safe_dist: correct, observable data-parallel Keras training on TensorFlow."""

from keras_safe_dist import callbacks
from keras_safe_dist.distributed import is_chief
from keras_safe_dist.model import SafeDistributedFunctional
from keras_safe_dist.model import SafeDistributedModel

__version__ = "0.1.0"

__all__ = [
    "callbacks",
    "is_chief",
    "SafeDistributedFunctional",
    "SafeDistributedModel",
    "__version__",
]
