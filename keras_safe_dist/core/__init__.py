"""The low room: what many parts of the package need, importing none of them.

Every other folder may import `core`; `core` imports nothing of the package
outside itself (`tests/test_layout.py` checks it). Here:

- `on_jax()`: which backend Keras runs on;
- `creation_site()`: where the user's code created something;
- `SafeModel` and `is_safe_model()`: whether a model is ours, asked without
  importing the model (which imports nearly everything);
- the plumbing, in private modules: files on local and remote paths
  (`_files`), a folder's lock (`_lock`), strict JSON (`_json`), argument
  checks (`_validate`), TensorFlow imported on first use (`_lazy`), its start-up
  lines kept quiet (`_quiet`), warnings that name the user's line
  (`_warnings`).

Importing `core` imports neither Keras nor a backend library: the command
line's `launch` and `report` run without either.
"""

import inspect
import os

__all__ = ["UNKNOWN_SITE", "SafeModel", "creation_site", "is_safe_model", "on_jax"]


def on_jax():
    """Whether Keras runs on its JAX backend."""
    import keras

    return keras.backend.backend() == "jax"


class SafeModel:
    """The mark of keras_safe_dist's model classes (`SafeDistributedModel` inherits it).

    It adds no state and no behaviour: it lets the audits, the callbacks and
    the backends ask `is_safe_model(model)` without importing `model/`.
    """


def is_safe_model(model):
    """Whether `model` is a `SafeDistributedModel` (its update is exact).

    Args:
        model: any object.

    Returns:
        A bool.

    Example:

    ```python
    is_safe_model(keras_safe_dist.SafeDistributedModel(inputs, outputs))  # True
    is_safe_model(keras.Model(inputs, outputs))  # False
    ```
    """
    return isinstance(model, SafeModel)


# What `creation_site()` returns when every frame is a library's.
UNKNOWN_SITE = "unknown code"


def creation_site():
    """`"file.py:12 in MyCallback.on_train_begin"` for the innermost user frame.

    User code is the innermost frame outside Keras, TensorFlow, jax and
    keras_safe_dist (and the Python library folder, site-packages included).

    Returns:
        A str: `"<file name>:<line> in <function>"`, the function prefixed
        with the class of its `self`; `"unknown code"` when there is no user
        frame.

    Example:

    ```python
    class MyCallback(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            print(creation_site())  # train.py:12 in MyCallback.on_train_begin
    ```
    """
    from keras_safe_dist.core import _warnings

    frame = inspect.currentframe()
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_warnings.LIBRARIES) and not filename.startswith("<"):
            owner = frame.f_locals.get("self")
            function = frame.f_code.co_name
            if owner is not None:
                function = f"{type(owner).__name__}.{function}"
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {function}"
        frame = frame.f_back
    return UNKNOWN_SITE
