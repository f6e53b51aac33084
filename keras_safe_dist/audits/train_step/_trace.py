"""A fresh trace of a compiled train step, so the audit sees its layers' `training` value.

`jax.jit` and `tf.function` trace the Python function once per input shapes
and reuse the trace: a step the loop already ran (or an earlier audit ran) on
the same shapes does not call its layers again, so `TrainingModeRecorder` sees
nothing, and a missing `training=True` would show only as statistics that do
not move (`LOOP002`). `trace_afresh` traces the function under the wrapper
once more, wrapped in a new `functools.partial` (the caches are keyed by the
function), without running it: `jax.eval_shape` on JAX, a new `tf.function`'s
`get_concrete_function` on TensorFlow. The user's compiled step and its cache
are left as they are. Each library is imported here only when the step is
one of its compiled functions, that is when it is already imported.
"""

import functools

import keras

__all__ = ["trace_afresh"]


def trace_afresh(train_step, state, data):
    """Traces the Python function under a jitted step anew, without running it.

    Args:
        train_step: the audited step.
        state: the state the audit passes to the step.
        data: the batch the audit passes to the step.

    Returns:
        True when the step is a `jax.jit` or `tf.function` function and its
        Python function was traced; False for a plain function (it calls its
        layers at each step anyway) or when the trace raised (the run that
        follows raises too, with the audit's message, or the training mode
        stays unseen).
    """
    backend = keras.backend.backend()
    function = _compiled_function(train_step, backend)
    if function is None:
        return False
    fresh = functools.partial(function)
    try:
        if backend == "jax":
            import jax

            jax.eval_shape(fresh, state, data)
        else:
            import tensorflow as tf

            tf.function(fresh).get_concrete_function(state, data)
    except Exception:  # noqa: BLE001 - the step's own run reports its errors
        return False
    return True


def _compiled_function(train_step, backend):
    """The Python function under a `jax.jit` (JAX) or `tf.function` (TensorFlow) step, else None."""
    if backend == "jax" and callable(getattr(train_step, "lower", None)):
        function = getattr(train_step, "__wrapped__", None)
    elif backend == "tensorflow" and callable(getattr(train_step, "get_concrete_function", None)):
        function = getattr(train_step, "python_function", None)
    else:
        return None
    return function if callable(function) else None
