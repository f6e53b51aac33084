"""Per-worker data under `MultiWorkerMirroredStrategy`: each worker reads its own.

With `strategy.distribute_datasets_from_function(...)`, or a `tf.data.Dataset`
whose auto-shard policy leaves each worker data of its own (OFF, FILE, HINT),
each worker iterates a dataset of its own length. Keras takes an epoch's
length from the cardinality it reads on each worker: the local one (the
workers then run different step counts, and their all-reduces crash or
hang), or, with OFF, the number of batches before TensorFlow splits each of
them across the replicas (each epoch then trains on part of the data only).

Here Keras gets its own adapter for such data (in `fit()`, its validation,
`evaluate()` and `predict()`), reporting an epoch of unknown length.
TensorFlow all-reduces at every step whether any worker still has a batch (a
worker out of data takes an empty share, which the step handles), so every
worker ends the epoch on the same step, after the longest one's last batch:
each step trains on, or evaluates, the union of the workers' batches, as one
device would. A `steps_per_epoch` (or `steps`, `validation_steps`) given is
kept. Data that repeats forever on some workers only is refused on all.
"""

import contextlib
import inspect
import warnings

import keras
import tensorflow as tf

from keras_safe_dist.backend.tensorflow import _compat as _tf_compat

_POLICY = tf.data.experimental.AutoShardPolicy
# Policies under which a worker's batches are not the worker's share of each
# global batch: OFF and HINT without hints read everything on each worker,
# FILE and HINT with hints read each worker's files or shards.
_PER_WORKER_POLICIES = (_POLICY.OFF, _POLICY.FILE, _POLICY.HINT)


def fit_arguments(strategy, args, kwargs):
    """`fit()`'s arguments, with per-worker `x` and `validation_data` of unknown length.

    Args:
        strategy: the model's strategy.
        args: the positional arguments of `fit()`, `self` excluded.
        kwargs: its keyword arguments.

    Returns:
        `(args, kwargs)` to pass on to `keras.Model.fit`.

    Raises:
        ValueError: per-worker data repeats forever on some workers only.
    """
    bound = _workers(strategy) > 1 and _bind(keras.Model.fit, args, kwargs)
    if not bound:
        return args, kwargs
    get = _getter(bound)
    x = get("x")
    if is_per_worker(strategy, x) and not get("validation_split"):
        check_ends_agree(strategy, "fit", x, "x", "steps_per_epoch")
        if get("steps_per_epoch") is None:
            bound.arguments["x"] = unknown_length(
                x, get("y"), get("sample_weight"), get("batch_size"),
                get("shuffle"), get("class_weight"),
            )
    if get("validation_data") is not None:
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(get("validation_data"))
        if is_per_worker(strategy, val_x):
            check_ends_agree(strategy, "fit", val_x, "validation_data", "validation_steps")
            if get("validation_steps") is None:
                batch_size = get("validation_batch_size") or get("batch_size")
                bound.arguments["validation_data"] = unknown_length(
                    val_x, val_y, val_weight, batch_size, False, None
                )
    return bound.args[1:], bound.kwargs


def evaluate_arguments(strategy, args, kwargs):
    """`evaluate()`'s arguments, with a per-worker `x` of unknown length.

    The validation of `fit()` passes the adapter `fit_arguments` made, as is.

    Raises:
        ValueError: per-worker data repeats forever on some workers only.
    """
    if "_use_cached_eval_dataset" in kwargs:
        return args, kwargs
    return _steps_arguments(strategy, "evaluate", args, kwargs)


def predict_arguments(strategy, args, kwargs):
    """`predict()`'s arguments, with a per-worker `x` of unknown length.

    Raises:
        ValueError: per-worker data repeats forever on some workers only.
    """
    return _steps_arguments(strategy, "predict", args, kwargs)


def _steps_arguments(strategy, method, args, kwargs):
    """The arguments of `evaluate()` or `predict()`, which take `steps`."""
    bound = _workers(strategy) > 1 and _bind(getattr(keras.Model, method), args, kwargs)
    if not bound:
        return args, kwargs
    get = _getter(bound)
    x = get("x")
    if is_per_worker(strategy, x):
        check_ends_agree(strategy, method, x, "x", "steps")
        if get("steps") is None:
            bound.arguments["x"] = unknown_length(
                x, get("y"), get("sample_weight"), get("batch_size"), False, None
            )
    return bound.args[1:], bound.kwargs


@contextlib.contextmanager
def epoch_ends_expected(args, kwargs):
    """Silences Keras's "ran out of data" warning for the adapters made here.

    Keras warns at the end of each epoch of unknown length that the input
    "ran out of data" and advises `.repeat()`; here that end is the expected
    one, and a repeated per-worker dataset would never end.
    """
    if not any(isinstance(v, _tf_compat.UnknownLengthAdapter) for v in (*args, *kwargs.values())):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_tf_compat.RAN_OUT_OF_DATA, category=UserWarning)
        yield


def is_per_worker(strategy, data):
    """Whether each worker of `strategy` reads `data` of its own, of its own length."""
    if _workers(strategy) < 2:
        return False
    if isinstance(data, tf.data.Dataset):
        source = data
    elif isinstance(data, tf.distribute.DistributedDataset):
        source = _tf_compat.distributed_source(data)
        if source is None:  # distribute_datasets_from_function
            return _exact_here()
    else:
        return False
    if source.options().experimental_distribute.auto_shard_policy not in _PER_WORKER_POLICIES:
        return False
    return _exact_here()


def _exact_here():
    """True where per-worker data trains exactly; raises on the Keras releases where it does not."""
    if not _tf_compat.PER_WORKER_DATA_EXACT:
        raise ValueError(
            "Each worker reads data of its own here (distribute_datasets_from_function, or "
            "an auto_shard_policy of OFF, FILE or HINT). Under MultiWorkerMirroredStrategy "
            "SafeDistributedModel trains on such data exactly with Keras 3.15 or later; on "
            f"Keras {keras.__version__} it would train on other batches than one device does. "
            "Upgrade Keras to 3.15 or later, or let TensorFlow shard one dataset across the "
            "workers (auto_shard_policy AUTO or DATA)."
        )
    return True


def unknown_length(x, y, sample_weight, batch_size, shuffle, class_weight):
    """Keras's adapter for the data (its checks and warnings included), of unknown length."""
    return _tf_compat.UnknownLengthAdapter(
        _tf_compat.data_adapter(x, y, sample_weight, batch_size, shuffle, class_weight)
    )


def check_ends_agree(strategy, method, data, argument, steps_argument):
    """Raises on every worker when `data` repeats forever on some workers only.

    TensorFlow all-reduces whether a batch is left only where the data ends,
    so the workers' all-reduces would stop matching. One all-reduce of a flag
    per call: every worker takes the same decision.
    """
    cardinality = data.cardinality
    cardinality = int(cardinality() if callable(cardinality) else cardinality)
    infinite = cardinality == int(tf.data.INFINITE_CARDINALITY)
    flags = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant(1.0 if infinite else 0.0)
    )
    repeating = int(strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None))
    replicas = strategy.num_replicas_in_sync
    if 0 < repeating < replicas:
        raise ValueError(
            f"SafeDistributedModel.{method}() received a per-worker `{argument}` (each "
            "worker reads its own) that repeats forever on some workers and ends on the "
            f"others ({repeating} of the {replicas} replicas repeat it): the workers "
            "would disagree on when it ends, and their all-reduces would hang or crash. "
            "Expected data that ends on every worker, or repeats on every worker. "
            f"Received on this worker: cardinality {cardinality} "
            f"({'infinite' if infinite else 'ends'}). Make it end on every worker (each "
            "epoch then ends after the longest worker's last batch), or repeat it on "
            f"every worker and pass `{steps_argument}`."
        )


def _workers(strategy):
    """How many workers run `strategy` (1 for every strategy of one worker)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    return strategy.num_replicas_in_sync // max(len(strategy.extended.worker_devices), 1)


def _bind(method, args, kwargs):
    """The arguments bound to `method`'s signature; None where they do not bind."""
    try:
        return inspect.signature(method).bind(None, *args, **kwargs)
    except TypeError:
        return None  # Keras raises its own error


def _getter(bound):
    parameters = bound.signature.parameters

    def get(name):
        """The value `name` was given, its default, or None for no such parameter."""
        if name in bound.arguments:
            return bound.arguments[name]
        return parameters[name].default if name in parameters else None

    return get
