"""The arguments of `fit()`, `evaluate()` and `predict()`: where each is, and their checks.

`SafeDistributedModel` refuses a batch size Keras would misread and data that
holds no samples before any step, and hands Keras a generator's or a
`PyDataset`'s batches copied as it gives them (`core/_generators.py`).
"""

import inspect

import keras

from keras_safe_dist.core import _generators
from keras_safe_dist.core import _lazy
from keras_safe_dist.core import _validate
from keras_safe_dist.core import on_jax
from keras_safe_dist.scale_out import distributed

# Where each argument of keras.Model's fit, evaluate and predict is, without
# `self`: read once, not at each call (inspect.signature takes ~100 µs).
POSITIONS = {
    method.__name__: {
        name: index for index, name in enumerate(list(inspect.signature(method).parameters)[1:])
    }
    for method in (keras.Model.fit, keras.Model.evaluate, keras.Model.predict)
}


def check_batch_sizes(method, args, kwargs, names):
    """Raises a `ValueError` for a batch size that is neither None nor an integer >= 1.

    Stock Keras takes `batch_size=0` as no batch size (32 samples a batch),
    and fails on a negative one with a bare `StopIteration`.
    """
    for name in names:
        value = given(method, name, args, kwargs)
        if value is None or _validate.is_integer_at_least(value, 1):
            continue
        raise ValueError(
            f"SafeDistributedModel.{method}()'s `{name}` must be an integer >= 1 (samples "
            f"per micro-batch), or None for Keras's default. Received: {name}={value!r}"
            + (
                " (stock Keras would take 0 as None: 32 samples a batch)"
                if _validate.is_integer_at_least(value, 0)
                else ""
            )
        )


def given(method, name, args, kwargs):
    """The `name` argument of `keras.Model.<method>` as received, or None."""
    if name in kwargs:
        return kwargs[name]
    position = POSITIONS[method][name]
    return args[position] if len(args) > position else None


def checked(method, args, kwargs, strategy):
    """`args, kwargs` of `keras.Model.<method>` (`"evaluate"` or `"predict"`), checked.

    Raises for a batch size Keras would misread and for `x` that holds no
    samples; a generator's or a `PyDataset`'s batches are copied as it gives them.
    """
    check_batch_sizes(method, args, kwargs, ("batch_size",))
    check_has_samples(method, given(method, "x", args, kwargs), strategy)
    return fresh_batches(method, args, kwargs, ("x",))


def fresh_batches(method, args, kwargs, names):
    """`args, kwargs` of `keras.Model.<method>`, its `names` arguments that are
    generators or `PyDataset`s copying their batches' NumPy arrays (see
    `core/_generators.py`)."""
    args = list(args)
    for name in names:
        if name in kwargs:
            kwargs[name] = _generators.fresh_batches(kwargs[name])
            continue
        position = POSITIONS[method][name]
        if len(args) > position:
            args[position] = _generators.fresh_batches(args[position])
    return args, kwargs


def check_has_samples(method, x, strategy, argument="x"):
    """Raises when `x` (given as `argument`) is known, before any step, to hold no samples.

    Stock Keras 3.15 then returns an empty History (or list) on TensorFlow,
    raises a bare `StopIteration` on JAX, and fails in `predict()`; for
    `validation_data` it raises after the epoch's steps. Datasets of unknown
    length and generators are not read ahead. With several JAX processes, one
    process may hold no samples while others do: the processes check the
    global batch together (backend/jax/_process_batch.py); so may a
    MultiWorkerMirroredStrategy worker.
    """
    if on_jax() and distributed.jax_process()[1] > 1:
        return
    if strategy is not None and distributed.worker_name(strategy) != "chief":
        # Several MultiWorkerMirroredStrategy workers: one worker's own data may
        # hold no samples while another's does (it contributes empty shares).
        return
    # A tf.data.Dataset only where TensorFlow was imported (a JAX user has none).
    if _lazy.loaded("tensorflow") and isinstance(x, _lazy.tensorflow.data.Dataset):
        if int(x.cardinality()) != 0:
            return
        received = "a tf.data.Dataset of cardinality 0 (from .take(0), or a dataset built empty)"
    elif isinstance(x, keras.utils.PyDataset):
        if x.num_batches != 0:  # None: endless
            return
        received = f"a {type(x).__name__} (a keras.utils.PyDataset) of 0 batches"
    else:
        shapes = [
            tuple(t.shape) for t in keras.tree.flatten(x)
            if getattr(t, "shape", None) is not None and len(t.shape) > 0
        ]
        if not shapes or shapes[0][0] != 0:
            return
        received = f"{argument} of shape {shapes[0]}"
    if argument == "validation_data":
        purpose, stock = "validate on", "fails after the epoch's steps"
    else:
        purpose = {"fit": "train on", "evaluate": "evaluate", "predict": "predict"}[method]
        stock = (
            "fails with an UnboundLocalError" if method == "predict"
            else "returns an empty result on TensorFlow and raises a bare StopIteration on JAX"
        )
    raise ValueError(
        f"SafeDistributedModel.{method}() received {argument} that holds no samples, so "
        f"there is nothing to {purpose} (stock Keras {stock}). Received: "
        f"{received}. Pass data with at least one sample."
    )
