"""keras_safe_dist: correct, observable data-parallel Keras training on TensorFlow and JAX."""

import importlib
import importlib.util
import json
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
    _check_backend_installed()
    module = _EXPORTS[name]
    if module is None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _keras_backend():
    """The backend Keras will pick: `KERAS_BACKEND`, else `keras.json`'s, else "tensorflow"."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as file:
            return json.load(file).get("backend") or "tensorflow"
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def _why_tensorflow():
    if os.environ.get("KERAS_BACKEND"):
        return "KERAS_BACKEND=tensorflow"
    return "KERAS_BACKEND is not set, and Keras's default is tensorflow"


def _installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_backend_installed():
    """Refuses, with the fix, a Keras that would start on TensorFlow where there is none.

    Keras starts on TensorFlow unless told otherwise; a JAX user who forgot
    `KERAS_BACKEND=jax` would get Keras's traceback about a missing
    TensorFlow, which names no fix. Once Keras is imported its backend is
    fixed and Keras has already said so: nothing is checked then.
    """
    if "keras" in sys.modules:
        return
    backend = _keras_backend()
    if backend == "tensorflow" and not _installed("tensorflow"):
        jax = "jax is installed: " if _installed("jax") else ""
        raise ImportError(
            "keras_safe_dist: Keras would start on its TensorFlow backend "
            f"({_why_tensorflow()}), and TensorFlow is not installed. "
            f"{jax}set KERAS_BACKEND=jax before Python imports keras or keras_safe_dist "
            "(`export KERAS_BACKEND=jax`, or `os.environ['KERAS_BACKEND'] = 'jax'` at "
            'the top of the script), or install TensorFlow: pip install "keras-safe-dist[tensorflow]".'
        )


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
