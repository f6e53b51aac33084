"""The only module that touches private Keras APIs.

Every name used here is checked by `tests/test_compat.py`, so a Keras release
that renames or changes one fails that test loudly instead of breaking
training silently.
"""

import contextlib
import functools
import threading

import keras
import tensorflow as tf
from keras.src import backend as _keras_backend
from keras.src.backend.tensorflow import nn as _keras_tf_nn
from keras.src.backend.tensorflow import trainer as _keras_tf_trainer
from keras.src.losses import loss as _keras_loss
from keras.src.models import cloning as _keras_cloning
from keras.src.models.functional import Functional
from keras.src.trainers import trainer as _keras_trainer
from tensorflow.python.distribute import distribute_lib as _tf_distribute_lib
from tensorflow.python.distribute import values as _tf_values

# The class Keras instantiates for `Model(inputs=..., outputs=...)`.
Functional = Functional

# Loss reduction helpers, used to split a Keras loss into the numerator and
# denominator of its reduction.
reduce_weighted_values = _keras_loss.reduce_weighted_values
apply_mask = _keras_loss.apply_mask
squeeze_or_expand_to_same_rank = _keras_loss.squeeze_or_expand_to_same_rank


def model_strategy(model):
    """The strategy whose scope `model` was created under, or None."""
    return model._distribute_strategy


def default_strategy():
    """TensorFlow's default (no-op) strategy, in use outside every scope."""
    return _tf_distribute_lib._get_default_strategy()


def distributed_strategy(value):
    """The strategy that created a distributed variable."""
    return value._distribute_strategy


def flatten_layers(model):
    """Every layer inside `model`, nested ones included, `model` excluded."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def activity_losses(model):
    """The losses that layers with an activity regularizer added in the last call.

    Keras adds a layer's activity penalty with `add_loss()`, so a layer's own
    losses are its activity penalties (and whatever its `call` added itself).
    """
    return [
        loss
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if getattr(layer, "activity_regularizer", None) is not None
        for loss in layer._get_own_losses()
    ]


def _outside_traces():
    """A context in which ops run eagerly, also while a step is being traced."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.ensure_compile_time_eval()
    return tf.init_scope()


@functools.cache
def activity_penalty_per_sample():
    """Whether Keras divides a layer's activity penalty by the layer's batch size.

    keras 3.14 and later do, which makes the penalty a per-sample mean; earlier
    releases add it summed over the batch. Found once, by running a layer
    (outside any trace or scope the caller is in), not from version numbers.

    Raises:
        RuntimeError: the installed Keras follows neither convention.
    """
    with _outside_traces(), keras.StatelessScope(collect_losses=True):
        layer = keras.layers.Activation(
            "linear",
            activity_regularizer=keras.regularizers.L1(1.0),
            # Named, so that it takes no automatic name from the user's layers.
            name="keras_safe_dist_activity_probe",
        )
        layer(keras.ops.ones((4, 1)))
        penalty = float(layer.losses[0])
    if penalty not in (1.0, 4.0):
        raise RuntimeError(
            "keras_safe_dist does not know this Keras release's activity "
            "regularization: an L1(1.0) penalty on a batch of 4 ones came to "
            f"{penalty}, expected 1.0 (divided by the batch size, keras >= 3.14) "
            f"or 4.0 (summed, keras < 3.14). Keras {keras.__version__}."
        )
    return penalty == 1.0


def compile_loss(model):
    """Returns the `CompileLoss` built by `model.compile()`, or None."""
    return getattr(model, "_compile_loss", None)


def loss_tracker(model):
    """Returns the `Mean` metric that Keras logs as `loss`."""
    return model._loss_tracker


def compute_loss_is_overridden(model):
    """Whether `model` (or a parent below keras.Model) overrides compute_loss."""
    return type(model).compute_loss is not _keras_trainer.Trainer.compute_loss


def compute_loss(model, x, y, y_pred, sample_weight):
    """Calls `model.compute_loss` for training as Keras's own train step does.

    Keras's wrapper also supports overrides written before `compute_loss`
    took a `training` argument.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def call_has_training_arg(model):
    """Whether `model.call` takes a `training` argument."""
    return model._call_has_training_arg


def unscale_loss(value):
    """Undoes the 1 / replicas that Keras applies to losses under a strategy."""
    return _keras_loss.unscale_loss_for_distribution(value)


@contextlib.contextmanager
def swapped_loss_functions(compiled_loss, wrap):
    """Temporarily replaces each flat loss function of a built `CompileLoss`.

    Args:
        compiled_loss: a built `CompileLoss`.
        wrap: called as `wrap(index, loss_fn, loss_weight)` for each flat loss;
            returns the callable used in its place.
    """
    original = compiled_loss._flat_losses
    compiled_loss._flat_losses = [
        entry._replace(loss=wrap(i, entry.loss, entry.loss_weights))
        for i, entry in enumerate(original)
    ]
    try:
        yield
    finally:
        compiled_loss._flat_losses = original


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
# (`_shares.py`); that row must not enter the sums. While a thread runs such
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


def keras_mask(tensor):
    """Returns the Keras mask attached to `tensor`, or None."""
    return _keras_backend.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches a Keras mask to `tensor`."""
    _keras_backend.set_keras_mask(tensor, mask)


def set_initial_epoch(model, epoch):
    """Makes the next `fit()` of `model` start at `epoch` (None: at its `initial_epoch`).

    What Keras's `BackupAndRestore` sets to resume a run.
    """
    model._initial_epoch = epoch


def copy_options_on_clone(copy_options):
    """Makes `keras.models.clone_model` call `copy_options(model, clone)` for a functional model.

    Keras clones a functional model with `model.__class__(inputs, outputs,
    name=model.name)`, which passes none of a subclass's own constructor
    arguments; `copy_options` puts them on the clone. Installed once.
    """
    original = _keras_cloning._clone_functional_model
    if getattr(original, "_safe_dist_copy_options", None) is not None:
        return

    @functools.wraps(original)
    def clone_functional_model(model, *args, **kwargs):
        clone = original(model, *args, **kwargs)
        copy_options(model, clone)
        return clone

    clone_functional_model._safe_dist_copy_options = copy_options
    _keras_cloning._clone_functional_model = clone_functional_model


class EpochEndOverride:
    """Replaces the private `keras.Model` method every backend's `fit()` calls at an epoch's end.

    A class using this mixin implements `_update_log_names()`, the names its
    train step adds to the logs besides the metrics, and
    `_end_epoch_steps(logs)`, called when an epoch's steps are done, before
    Keras reads the epoch's logs, runs validation or calls `on_epoch_end`.
    """

    def _get_metrics_result_or_logs(self, logs):
        # Keras calls this once an epoch's steps are done, before validation
        # and the epoch-end callbacks.
        logs = self._end_epoch_steps(logs)
        # Keras replaces an epoch's last-step logs (each a mean of per-replica
        # results) with the metrics read across replicas, but only when the
        # keys match exactly. Keep that exact read with extra log names.
        names = self._update_log_names()
        if isinstance(logs, dict) and all(name in logs for name in names):
            metric_logs = {k: v for k, v in logs.items() if k not in names}
            result = dict(super()._get_metrics_result_or_logs(metric_logs))
            result.update({name: logs[name] for name in names})
            return result
        return super()._get_metrics_result_or_logs(logs)


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
            return super()._make_function(step_function)
        return _multi_step_function(
            strategy, step_function, self.steps_per_execution, ends
        )

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


# JAX (keras.distribution). jax is imported inside these functions only: on
# TensorFlow's backend importing keras_safe_dist must not import it.


@contextlib.contextmanager
def losses_override(model, losses):
    """While open, `model.losses` reads `losses`, as Keras's JAX step sets them.

    `stateless_call(..., return_losses=True)` returns the forward pass's
    `add_loss()` and activity losses instead of leaving them on the layers.
    """
    model._losses_override.clear()
    model._losses_override = list(losses)
    try:
        yield
    finally:
        model._losses_override.clear()


def jax_data_placement():
    """The module whose `distribute_data_input` Keras's JAX trainer places each batch with."""
    from keras.src.backend.jax import distribution_lib

    return distribution_lib


@contextlib.contextmanager
def uneven_batches_replicated():
    """While open, Keras's JAX trainer places a batch the data axis does not divide replicated.

    Keras shards each global batch along the distribution's batch axis, which
    fails (`IndivisibleError`) when the device count does not divide the
    batch. Such a batch is placed whole on every device instead: each device
    computes the same step on every sample, the one-device result, without
    the data-parallel speed-up. Divisible batches are placed as Keras places
    them. Re-entrant; restores Keras's function on exit.
    """
    module = jax_data_placement()
    original = module.distribute_data_input
    if getattr(original, "_keras_safe_dist", False):
        yield
        return

    def distribute_data_input(per_process_batch, layout, batch_dim_name):
        replicated = _replicated_if_indivisible(per_process_batch, layout)
        if replicated is None:
            return original(per_process_batch, layout, batch_dim_name)
        return replicated

    distribute_data_input._keras_safe_dist = True
    module.distribute_data_input = distribute_data_input
    try:
        yield
    finally:
        module.distribute_data_input = original


def _replicated_if_indivisible(batch, layout):
    import jax
    from keras.src.distribution import TensorLayout

    if isinstance(layout, TensorLayout):
        layout = layout.backend_layout
    spec = getattr(layout, "spec", None)
    if spec is None or len(spec) == 0 or spec[0] is None or not batch.shape:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    parts = 1
    for axis in axes:
        parts *= layout.mesh.shape[axis]
    if batch.shape[0] % parts == 0:
        return None
    if jax.process_count() > 1:
        raise ValueError(
            f"A batch of {batch.shape[0]} samples on this process does not split "
            f"across the {parts} shards of the data-parallel axis, and with "
            f"{jax.process_count()} processes it cannot be placed whole on every "
            "device (each process holds different samples). Use a batch size "
            f"divisible by {parts}, and drop or pad the remainder of the data."
        )
    return jax.device_put(
        batch, jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    )
