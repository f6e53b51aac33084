"""keras_safe_dist: correct, observable data-parallel Keras training on TensorFlow and JAX."""

import importlib
import os
import sys

__version__ = "0.1.0"

# public name: the module that defines it
_EXPORTS = {
    "AuditReport": "keras_safe_dist.findings",
    "Finding": "keras_safe_dist.findings",
    "ScopeError": "keras_safe_dist.audits",
    "audit": "keras_safe_dist.audits",
    "audit_train_step": "keras_safe_dist.audits",
    "callbacks": None,  # the subpackage itself
    "initialize": "keras_safe_dist.scale_out.distributed",
    "is_chief": "keras_safe_dist.scale_out.distributed",
    "SafeDistributedFunctional": "keras_safe_dist.model",
    "SafeDistributedModel": "keras_safe_dist.model",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _command_line():
    """Whether this process is the `keras-safe-dist` command (`python -m keras_safe_dist` too)."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    return program in ("keras-safe-dist", "-m")


# Importing the package registers SafeDistributedModel and the callbacks with
# Keras's serialization (`keras.saving.load_model` after `import
# keras_safe_dist`). The command line, whose `launch` and `report` need no
# TensorFlow, loads them on first use instead.
if not _command_line():
    for _name in _EXPORTS:
        __getattr__(_name)
