"""The private Keras APIs JAX's step relies on.

With `keras_safe_dist/_compat.py` (the backend-neutral ones) the only place
that touches them; `tests_jax/test_compat.py` checks every name used here, so
a Keras release that renames or changes one fails that test loudly.
"""

import contextlib

import jax
import keras
from keras.src.backend.jax import distribution_lib as _keras_jax_distribution_lib
from keras.src.backend.jax import trainer as _keras_jax_trainer
from keras.src.distribution import TensorLayout


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


def epoch_iterator_class():
    """Keras's JAX epoch iterator: it batches the data and places each batch on the devices."""
    return _keras_jax_trainer.JAXEpochIterator


class InterruptedWarningWhen:
    """A mixin for Keras's JAX epoch iterator: Keras warns that the input ran out only
    where `input_interrupted()` says so.

    Keras calls `_interrupted_warning()` whenever the data raises
    StopIteration inside a `fit()`, `evaluate()` or `predict()` step.
    """

    def input_interrupted(self):
        return True

    def _interrupted_warning(self):
        if self.input_interrupted():
            super()._interrupted_warning()


@contextlib.contextmanager
def epoch_iterator_replaced(cls):
    """While open, Keras's JAX `fit()`, `evaluate()` and `predict()` iterate with `cls`.

    Keras looks the class up in its trainer module at each call. Re-entrant
    (`fit()` calls `evaluate()` for validation); restores Keras's class on exit.
    """
    original = _keras_jax_trainer.JAXEpochIterator
    _keras_jax_trainer.JAXEpochIterator = cls
    try:
        yield
    finally:
        _keras_jax_trainer.JAXEpochIterator = original


def host_batches_are_fresh(epoch_iterator):
    """Whether `epoch_iterator`'s data gives each batch as arrays nothing refills later.

    Keras's array adapter slices the arrays passed to `fit()`, and its
    tf.data adapter converts each element to new NumPy arrays. A generator
    or a `keras.utils.PyDataset` may fill one buffer again for each batch,
    so a reference to one of its batches can change after the step.
    """
    from keras.src.trainers.data_adapters import array_data_adapter
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    fresh = (array_data_adapter.ArrayDataAdapter, tf_dataset_adapter.TFDatasetAdapter)
    return isinstance(epoch_iterator.data_adapter, fresh)


def reads_generator_or_py_dataset(epoch_iterator):
    """Whether `epoch_iterator`'s data is a Python generator or a `keras.utils.PyDataset`."""
    from keras.src.trainers.data_adapters import generator_data_adapter
    from keras.src.trainers.data_adapters import py_dataset_adapter

    adapters = (generator_data_adapter.GeneratorDataAdapter, py_dataset_adapter.PyDatasetAdapter)
    return isinstance(epoch_iterator.data_adapter, adapters)


def record_host_batches(epoch_iterator, record):
    """Calls `record(batch)` with each batch the data gives `epoch_iterator`,
    before Keras's JAX epoch iterator places it on the devices.

    That iterator reads its batches from its data adapter's
    `get_jax_iterator()`, at each `_get_iterator()` call; this wraps the
    method on that one adapter.
    """
    adapter = epoch_iterator.data_adapter
    batches = adapter.get_jax_iterator

    def get_jax_iterator():
        for batch in batches():
            record(batch)
            yield batch

    adapter.get_jax_iterator = get_jax_iterator


def coordination_client():
    """jax's client of the coordination service's key-value store; None in one process.

    Private to jax (`jax._src.distributed`), unchanged from jax 0.10 to 0.12:
    `key_value_set(key, value, allow_overwrite=False)`, `key_value_try_get(key)`.
    """
    from jax._src import distributed

    return distributed.global_state.client


def initialize_rng():
    """What `keras.distribution.initialize()` does after `jax.distributed.initialize()`.

    Agrees on one seed for Keras's global random generator across processes.
    """
    _keras_jax_distribution_lib.initialize_rng()


def jax_data_placement():
    """The module whose `distribute_data_input` Keras's JAX trainer places each batch with."""
    return _keras_jax_distribution_lib


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


def lay_out_variable(variable, layout):
    """Gives `variable` the `layout` Keras gives it at creation, and moves its value there.

    A `keras.Variable` created under a distribution keeps its layout in
    `_layout`, and each assignment places the value with it (Keras's JAX
    `Variable._direct_assign`). Setting it afterwards, then assigning the
    variable its own value, makes the variable as if created under the
    distribution: the value is the same, laid out on the distribution's
    devices, and later assignments (`load_weights`) are placed there too.
    """
    variable._layout = layout
    variable.assign(variable.value)


# Model attributes that Keras's JAX loops set at every step with the step's
# state: the arrays, as a dict of lists (`fit`, `evaluate`, `predict`).
STEP_STATE_ATTRIBUTES = ("_jax_state",)


def set_untracked(model, name, value):
    """Sets `model.name` without Keras's attribute tracking.

    `Layer.__setattr__` walks every value it is given to find variables and
    layers, wrapping each list and dict it meets; on the step's state (only
    arrays) that finds nothing and costs about 1 microsecond an array on the
    host, every step.
    """
    object.__setattr__(model, name, value)


def forget_step_state(model):
    """Drops the state a `train_on_batch()` left on the model (`model._jax_state`).

    Keras's JAX `fit()` sets it after each of its steps and clears it when it
    ends; only its end-of-fit sync reads it before the first step sets it, and
    then it would put that call's arrays back on the model. Called when a
    `fit()` begins, so that `put_back_at_sync` sees no step's state there.
    """
    set_untracked(model, "_jax_state", None)


def put_back_at_sync(model, state):
    """Makes Keras's `jax_state_sync()` put `state` back on the model, when no step's state is there.

    Keras's JAX `fit()` takes the variables' values off the model for its first
    step (`_get_jax_state(purge_model_variables=True)`) and puts back only what
    a step returned (`model._jax_state`, at its `finally`): a first step that
    raises while it is traced would leave every variable without a value.
    `state` is the step's input, `(trainable, non_trainable, optimizer,
    metrics)` values. Returns whether it was put (not when a step's state is
    there, or an array of `state` was donated already).
    """
    if getattr(model, "_jax_state", None) or any(
        value.is_deleted() for values in state for value in values if isinstance(value, jax.Array)
    ):
        return False
    names = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")
    set_untracked(model, "_jax_state", dict(zip(names, state)))
    model._jax_state_synced = False
    return True


def latest_metrics_values(model):
    """The metrics' variables' values after the last step of Keras's JAX `fit()`, or None.

    Between steps Keras's JAX trainer keeps the state off the model, in
    `model._jax_state` (written after each step, read by `jax_state_sync()`),
    and donates it to the next step. None before a `fit()`'s first step.
    """
    state = getattr(model, "_jax_state", None)
    if not state:
        return None
    return state.get("metrics_variables")


def fresh_variable_layout(distribution, variable):
    """The layout `distribution` gives `variable`, as if the variable were created under it.

    Keras's `get_variable_layout` returns the layout a variable was given at
    creation (its `_layout`) when it has one: a variable created under
    another distribution would look right under this one.
    """
    saved = variable._layout
    variable._layout = None
    try:
        return distribution.get_variable_layout(variable)
    finally:
        variable._layout = saved


def variable_like(source, name, dtype, value=None):
    """A new `keras.Variable` laid out as `source` is: its shape, `source`'s layout.

    As Keras's optimizers create their slots (`add_variable_from_reference`
    passes the reference's `_layout`): under `ModelParallel` the new variable
    is sharded as `source` is from the start, never a full copy on each
    device. `value` (an array laid out like `source`), else zeros.
    """
    layout = getattr(source, "_layout", None)
    if value is not None:
        # Placed with `layout` as given (no copy where it is laid out so already).
        return keras.Variable(value, dtype=dtype, trainable=False, name=name, layout=layout)
    return keras.Variable(
        initializer="zeros", shape=source.shape, dtype=dtype, trainable=False, name=name,
        layout=layout,
    )


def optimizer_slot_references(optimizer, variables):
    """`{id(slot): variable}` for the optimizer's variables made from one of `variables`.

    Keras names a slot `<variable path with '/' as '_'>_<slot name>`
    (`add_variable_from_reference`) and gives it the variable's layout.
    Slots named otherwise (a custom optimizer's) are not in the result.
    """
    prefixes = sorted(
        ((v.path.replace("/", "_") + "_", v) for v in variables), key=lambda item: -len(item[0])
    )
    references = {}
    for slot in optimizer.variables:
        for prefix, variable in prefixes:
            if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(variable.shape):
                references[id(slot)] = variable
                break
    return references
