"""The private Keras and TensorFlow APIs TensorFlow's step relies on.

With `keras_safe_dist/_compat.py` (the backend-neutral ones) the only place
that touches them; `tests/test_compat.py` checks every name used here, so a
release that renames or changes one fails that test loudly instead of
breaking training silently.
"""

import contextlib
import functools
import threading

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import nn as _keras_tf_nn
from keras.src.backend.tensorflow import trainer as _keras_tf_trainer
from keras.src.trainers import data_adapters as _keras_data_adapters
from keras.src.trainers.data_adapters.data_adapter import DataAdapter as _KerasDataAdapter
from tensorflow.python.distribute import distribute_lib as _tf_distribute_lib
from tensorflow.python.distribute import values as _tf_values

from keras_safe_dist._compat import EpochEndOverride
from keras_safe_dist.backend.tensorflow import _replica_shares


def default_strategy():
    """TensorFlow's default (no-op) strategy, in use outside every scope."""
    return _tf_distribute_lib._get_default_strategy()


def distributed_strategy(value):
    """The strategy that created a distributed variable."""
    return value._distribute_strategy


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Stops a TensorFlow-backend optimizer from all-reducing gradients.

    Inside this context `optimizer.apply()` trusts that its gradients were
    already summed across replicas, so the update costs no second all-reduce.
    """
    optimizer._all_reduce_sum_gradients = _identity
    try:
        yield
    finally:
        del optimizer._all_reduce_sum_gradients


def _identity(grads_and_vars):
    return list(grads_and_vars)


# Synchronized BatchNormalization sums each replica's batch statistics with
# `_compute_moments_sync(x, axes, keepdims)` in Keras's TensorFlow backend. A
# replica whose share of a batch is empty runs one row of zeros instead
# (`_empty_shares.py`); that row must not enter the sums. While a thread runs such
# a forward pass, `_padding.rows` holds how many rows at the end of the batch
# are padding (a scalar tensor, 0 or 1), and the sums leave them out.
_padding = threading.local()
_stock_moments_sync = _keras_tf_nn._compute_moments_sync


def _moments_sync_without_padding(x, axes, keepdims):
    pad = getattr(_padding, "rows", None)
    if pad is None or 0 not in [a % x.shape.rank for a in axes]:
        return _stock_moments_sync(x, axes, keepdims)
    replica_ctx = tf.distribute.get_replica_context()
    if not replica_ctx:
        return _stock_moments_sync(x, axes, keepdims)
    rows = tf.shape(x)[0]
    real = tf.sequence_mask(rows - tf.cast(pad, rows.dtype), rows, dtype=x.dtype)
    real = tf.reshape(real, [-1] + [1] * (x.shape.rank - 1))
    # Keras's own computation, with each row weighted 1 (real) or 0 (padding).
    local_count = tf.reduce_sum(tf.ones_like(x) * real, axis=axes, keepdims=True)
    local_sum = tf.reduce_sum(x * real, axis=axes, keepdims=True)
    local_squared_sum = tf.reduce_sum(tf.square(x) * real, axis=axes, keepdims=True)
    y_sum = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM, local_sum)
    y_squared_sum = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM, local_squared_sum)
    count_sum = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM, local_count)
    mean = tf.math.divide_no_nan(y_sum, count_sum)
    y_squared_mean = tf.math.divide_no_nan(y_squared_sum, count_sum)
    variance = tf.maximum(y_squared_mean - tf.square(mean), 0.0)
    if not keepdims:
        mean = tf.squeeze(mean, axes)
        variance = tf.squeeze(variance, axes)
    return mean, variance


@contextlib.contextmanager
def padding_left_out_of_synchronized_moments(rows):
    """Synchronized BatchNormalization leaves the batch's last `rows` rows out.

    For the forward pass this thread runs inside the context (one replica's,
    under `MirroredStrategy`). The first use puts a wrapper in place of
    Keras's `_compute_moments_sync` for good; outside this context the
    wrapper calls Keras's own function.

    Args:
        rows: a scalar tensor, the number of padding rows at the batch's end.
    """
    if _keras_tf_nn._compute_moments_sync is _stock_moments_sync:
        _keras_tf_nn._compute_moments_sync = _moments_sync_without_padding
    previous = getattr(_padding, "rows", None)
    _padding.rows = rows
    try:
        yield
    finally:
        _padding.rows = previous


class TrainerOverrides(EpochEndOverride):
    """Replacements for the private `keras.Model` methods TensorFlow's `fit()` calls.

    A class using this mixin implements `_update_log_names()`, the names its
    `train_step` adds to the logs besides the metrics, and
    `_end_epoch_steps(logs)`, called when an epoch's steps are done, before
    Keras reads the epoch's logs, runs validation or calls `on_epoch_end`.
    While it makes its train function it may set `_execution_ends` (see
    `_multi_step_function`'s `ends`) to end an execution of several steps
    early; None otherwise.
    """

    _execution_ends = None

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Stock Keras MEAN-reduces the first distributed batch to build the
        # model, which crashes when that batch splits unevenly across replicas
        # and under MultiWorkerMirroredStrategy, and takes that batch from a
        # one-shot generator. The element spec of the dataset, one replica's
        # share with an unknown batch dimension, is all a build needs.
        strategy = self.distribute_strategy
        if iterator is not None:
            specs = tf.nest.map_structure(
                _spec_tensor, iterator._get_iterator().element_spec
            )
        else:
            specs = keras.tree.map_structure(
                lambda v: _batch_spec(strategy, v), data_batch
            )
        _remember_train_data_specs(self, specs)
        with strategy.scope():
            self._symbolic_build(data_batch=specs)

    def _make_function(self, step_function):
        # Keras runs `steps_per_execution` steps in a while loop with a
        # `tf.cond` per step that calls a nested `tf.function` holding
        # `strategy.run`; under MirroredStrategy that fails ("You must feed a
        # value for placeholder tensor"). Calling `strategy.run` directly in
        # the loop works, merge calls included.
        strategy = self.distribute_strategy
        ends = self._execution_ends
        if (
            self.steps_per_execution == 1
            or self.run_eagerly
            or (strategy.num_replicas_in_sync == 1 and ends is None)
        ):
            function = super()._make_function(step_function)
        else:
            function = _multi_step_function(
                strategy, step_function, self.steps_per_execution, ends
            )
        # train_on_batch() and test_on_batch() give it one batch, whole: split it.
        return _replica_shares.splitting(strategy, function)

def _multi_step_function(strategy, step_function, steps, ends=None):
    """A train or test function running up to `steps` steps per call on several replicas.

    Returns the last step's logs, as Keras's own does; raises `StopIteration`
    when the iterator had no batch left (Keras then ends the epoch). Every
    replica (and worker) sees the same `has_value()` and the same reduced
    logs, so all take the same branch.

    Args:
        strategy: the model's strategy.
        step_function: one replica's step, `data -> logs`.
        steps: the most steps one call runs.
        ends: None, or an object whose `ends_execution(logs)` says (a scalar
            bool tensor, from a step's reduced logs) that the call returns
            after that step; the logs then carry the number of steps the call
            ran under `ends.count_name`.
    """

    def one_step(data):
        data = keras.tree.map_structure(
            lambda i: None if isinstance(i, tf.experimental.Optional) else i, data
        )
        outputs = strategy.run(step_function, args=(data,))
        return _keras_tf_trainer.reduce_per_replica(outputs, strategy, reduction="auto")

    def go_on(logs):
        if ends is None:
            return tf.constant(True)
        return tf.logical_not(ends.ends_execution(logs))

    def multi_step(iterator):
        # The step is traced once, inside the loop: the loop carries its logs
        # in an Optional whose element spec is set when the step is traced
        # (the branch that runs it is traced first), as Keras's own loop does.
        # The structure of the logs is unknown before that trace.
        empty = tf.experimental.Optional.empty(None)

        def body(count, outputs, more):
            following = iterator.get_next_as_optional()

            def run():
                logs = one_step(following.get_value())
                ran = tf.experimental.Optional.from_value(logs)
                set_optional_spec(empty, ran.element_spec)
                return count + 1, ran, go_on(logs)

            def no_batch():
                set_optional_spec(outputs, empty.element_spec)
                return count, outputs, tf.constant(False)

            return tf.cond(following.has_value(), run, no_batch)

        count, outputs, _ = tf.while_loop(
            lambda count, outputs, more: tf.logical_and(more, count < steps),
            body,
            (tf.constant(0), empty, tf.constant(True)),
        )
        set_optional_spec(outputs, empty.element_spec)
        return count, outputs

    multi_step = tf.function(multi_step, reduce_retracing=True, autograph=False)
    single_step = tf.function(one_step, reduce_retracing=True, autograph=False)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            count, outputs = multi_step(iterator)
            if not outputs.has_value():  # one host read per call, as Keras's own
                raise StopIteration
            logs = outputs.get_value()
            if ends is not None:
                logs = dict(logs, **{ends.count_name: count})
            return logs
        # train_on_batch / test_on_batch pass a generator of one batch.
        for data in iterator:
            logs = single_step(data)
        return logs

    return function


def set_optional_spec(optional, spec):
    """Sets the element spec of a `tf.experimental.Optional` after its creation.

    An Optional carried by a `tf.while_loop` may be created empty, before the
    structure of its value is known (Keras's TensorFlow trainer does this).
    """
    optional._element_spec = spec


# Per-worker data of unknown length (`_per_worker.py`) matches one device on
# Keras 3.15; on Keras 3.10 (the floor) the same run trains on other batches
# (0.73 relative from one device, tests/test_per_worker.py), and the releases
# between are not measured: the data is refused there rather than trained on
# wrongly. A release tuple, the one version comparison of this module.
PER_WORKER_DATA_EXACT = tuple(int(part) for part in keras.__version__.split(".")[:2]) >= (3, 15)


def data_adapter(x, y, sample_weight, batch_size, shuffle, class_weight):
    """Keras's own data adapter for `fit()`/`evaluate()` data, with its checks and warnings."""
    return _keras_data_adapters.get_data_adapter(
        x=x,
        y=y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        steps_per_epoch=None,
        shuffle=shuffle,
        class_weight=class_weight,
    )


# The start of the warning Keras gives where an epoch of unknown length ends.
RAN_OUT_OF_DATA = "Your input ran out of data"


class UnknownLengthAdapter(_KerasDataAdapter):
    """Keras's adapter for some data, reporting an epoch of unknown length.

    Keras uses a `DataAdapter` passed as `x` as it is, and runs an epoch of
    unknown length (`num_batches` None) until the iterator has no batch left.
    """

    def __init__(self, adapter):
        self._adapter = adapter

    def get_tf_dataset(self):
        return self._adapter.get_tf_dataset()

    def get_numpy_iterator(self):
        return self._adapter.get_numpy_iterator()

    @property
    def num_batches(self):
        return None

    @property
    def batch_size(self):
        return self._adapter.batch_size

    @property
    def has_partial_batch(self):
        return None

    @property
    def partial_batch_size(self):
        return None

    def on_epoch_begin(self):
        self._adapter.on_epoch_begin()

    def on_epoch_end(self):
        self._adapter.on_epoch_end()


def distributed_source(data):
    """The `tf.data.Dataset` a `DistributedDataset` was made from, or None.

    None for a `DistributedDatasetsFromFunction` (each worker made its own
    dataset) or a distributed dataset rebuilt from its components.
    """
    return getattr(data, "_original_dataset", None)


def variable_creator_count():
    """How many variable creator scopes are active on this thread."""
    return len(tf.compat.v1.get_default_graph()._variable_creator_stack)


def train_data_specs(model):
    """The specs of one replica's share of the batches `fit()` last built from, or None."""
    return model.__dict__.get("_safe_dist_train_data_specs")


def _remember_train_data_specs(model, specs):
    # Stored past Keras's attribute tracking, which would wrap the structure.
    model.__dict__["_safe_dist_train_data_specs"] = specs


def _batch_spec(strategy, value):
    if value is None:
        return None
    if isinstance(value, tf.distribute.DistributedValues):
        value = strategy.experimental_local_results(value)[0]
    return _spec_tensor(tf.type_spec_from_value(value))


def _spec_tensor(spec):
    """A KerasTensor for one replica's share of a batch of type `spec`, or None."""
    if isinstance(spec, _tf_values.PerReplicaSpec):
        spec = spec._value_specs[0]
    if isinstance(spec, tf.OptionalSpec):
        # An optional input: None from a generator, or a value.
        spec = spec._element_spec
    if not isinstance(
        spec, (tf.TensorSpec, tf.SparseTensorSpec, tf.RaggedTensorSpec)
    ):
        return None
    shape = tuple(spec.shape) if spec.shape.rank is not None else (None,)
    if shape:
        shape = (None,) + shape[1:]
    return keras.KerasTensor(
        shape,
        dtype=spec.dtype.name,
        sparse=isinstance(spec, tf.SparseTensorSpec),
        ragged=isinstance(spec, tf.RaggedTensorSpec),
    )


# Ops through which a step's data enters its graph.
_DATA_OPS = frozenset({
    "IteratorGetNext",
    "IteratorGetNextSync",
    "IteratorGetNextAsOptional",
    "OptionalGetValue",
    "MultiDeviceIteratorGetNextFromShard",
})


def same_for_every_sample(tensor):
    """Whether a traced `tensor` depends on no data of the step (a constant's descendant).

    Walks `tensor`'s ops back to their sources: any data op, or any input of
    the function being traced (a `Placeholder` that is not a captured
    constant), makes it data. Reads TensorFlow's `FuncGraph.captures`. False
    when executing eagerly (nothing to walk).
    """
    if tf.executing_eagerly() or not hasattr(tensor, "op"):
        return False
    seen = set()
    stack = [tensor.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in _DATA_OPS:
            return False
        if op.type == "Placeholder" and not _captured_constant(op):
            return False
        stack.extend(source.op for source in op.inputs)
    return True


def _captured_constant(placeholder):
    """Whether `placeholder` holds a constant the traced function captured from outside."""
    for external, internal in getattr(placeholder.graph, "captures", ()):
        if internal.op is placeholder:
            return isinstance(external, tf.Tensor) and hasattr(external, "numpy") and (
                external.dtype != tf.resource
            )
    return False


def instance_function(function, **options):
    """`tf.function(function, **options)` whose traces TensorFlow counts on their own.

    `function`: a bound method or a closure of one instance (a model, an
    engine). TensorFlow counts the traces of every tf.function of one code
    object together (its private `_get_key_for_call_stats`) and warns of
    "retracing" once five of the last calls traced: models built one after
    another, each tracing its own function once as it must, read as one
    function retracing. A `functools.partial` has no code object, so
    TensorFlow counts it apart.
    """
    return tf.function(functools.partial(function), **options)
