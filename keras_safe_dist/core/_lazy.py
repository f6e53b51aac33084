"""TensorFlow, imported on first use, for the backend-neutral modules.

A JAX user has jax, keras and tensorboard, not TensorFlow, so a module outside
`backend/tensorflow/` must not import it when it is imported. The checks that
exist only under `tf.distribute` (variable aggregation, strategy scopes,
multi-worker strategies) still live beside their backend-neutral callbacks;
they reach TensorFlow through `tensorflow` below, which imports it when one of
its attributes is first read, as Keras's own backend-neutral trainers do
(`keras.src.utils.module_utils.tensorflow`). Code that runs on every backend
asks `loaded("tensorflow")` instead of touching it: a value cannot be a
TensorFlow object where TensorFlow was never imported.
"""

import importlib
import sys

__all__ = ["CHECKS", "LazyModule", "loaded", "tensorflow"]


class LazyModule:
    """A module imported when one of its attributes is first read.

    Args:
        name: the module's import name.
        needed_for: what needs it, for the error when it is not installed.
        extra: the keras-safe-dist extra that installs what it needs.

    Example:

    ```python
    tf = LazyModule("tensorflow", "tf.distribute strategies", "tensorflow")
    tf.distribute.get_strategy()  # imports tensorflow here
    ```
    """

    def __init__(self, name, needed_for, extra):
        self._name = name
        self._needed_for = needed_for
        self._extra = extra
        self._module = None

    def __getattr__(self, attribute):
        # copy, pickle and inspect probe other dunders; a module's own are read.
        if attribute.startswith("__") and attribute not in ("__version__", "__file__", "__path__"):
            raise AttributeError(attribute)
        if self._module is None:
            try:
                self._module = importlib.import_module(self._name)
            except ImportError as error:
                raise ImportError(
                    f"{self._needed_for} needs {self._extra}, which is not installed "
                    f"({error}). Install it with `pip install 'keras-safe-dist[{self._extra}]'`."
                ) from error
        return getattr(self._module, attribute)


def loaded(name):
    """Whether the module `name` was imported already in this process (by anyone)."""
    return name in sys.modules


CHECKS = "keras_safe_dist's tf.distribute checks"
tensorflow = LazyModule("tensorflow", CHECKS, "tensorflow")
