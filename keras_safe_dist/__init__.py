"""keras_safe_dist: correct, observable data-parallel Keras training on TensorFlow."""

from keras_safe_dist import callbacks
from keras_safe_dist.audits import ScopeError
from keras_safe_dist.audits import audit
from keras_safe_dist.distributed import is_chief
from keras_safe_dist.findings import AuditReport
from keras_safe_dist.findings import Finding
from keras_safe_dist.model import SafeDistributedFunctional
from keras_safe_dist.model import SafeDistributedModel

__version__ = "0.1.0"

__all__ = [
    "AuditReport",
    "Finding",
    "ScopeError",
    "audit",
    "callbacks",
    "is_chief",
    "SafeDistributedFunctional",
    "SafeDistributedModel",
    "__version__",
]
