"""The private Keras APIs the JAX step relies on (through `keras_safe_dist._compat`).

Each test fails loudly when a Keras release renames or changes one.
"""

import inspect

import jax
import keras
import numpy as np
import pytest
from keras.src.backend.jax import trainer as keras_jax_trainer

from keras_safe_dist.backend.jax import _compat as _jax_compat


def _parameters(function):
    return list(inspect.signature(function).parameters)


def test_batches_are_placed_through_the_module_function_the_context_swaps():
    module = _jax_compat.jax_data_placement()
    assert _parameters(module.distribute_data_input) == [
        "per_process_batch", "layout", "batch_dim_name",
    ]
    # Keras looks the function up on the module at each call, which is what
    # lets the context replace it.
    source = inspect.getsource(keras_jax_trainer._distribute_data)
    assert "jax_distribution_lib.distribute_data_input" in source
    assert keras_jax_trainer.jax_distribution_lib is module


def test_the_context_places_an_indivisible_batch_whole_and_restores_keras():
    module = _jax_compat.jax_data_placement()
    original = module.distribute_data_input
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    batch = np.arange(6, dtype="float32").reshape(3, 2)
    layout = distribution.get_data_layout(batch.shape).backend_layout

    with _jax_compat.uneven_batches_replicated():
        with _jax_compat.uneven_batches_replicated():  # re-entrant
            placed = module.distribute_data_input(batch, layout, "batch")
        even = module.distribute_data_input(batch[:2], layout, "batch")

    assert module.distribute_data_input is original
    assert placed.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(placed), batch)
    assert not even.sharding.is_fully_replicated
    with pytest.raises(Exception, match="divisible|partitioned"):
        original(batch, layout, "batch")


def _spied_placement(monkeypatch):
    module = _jax_compat.jax_data_placement()
    calls = []
    keras_function = module.distribute_data_input

    def spy(per_process_batch, layout, batch_dim_name):
        calls.append(per_process_batch)
        return keras_function(per_process_batch, layout, batch_dim_name)

    monkeypatch.setattr(module, "distribute_data_input", spy)
    return module, calls


def test_a_divisible_batch_is_left_to_keras(monkeypatch):
    module, calls = _spied_placement(monkeypatch)
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    numpy_batch = np.ones((4, 2), "float32")
    jax_batch = jax.numpy.ones((4, 2))
    odd = np.ones((3, 2), "float32")

    with _jax_compat.uneven_batches_replicated():
        for batch in (numpy_batch, jax_batch):
            placed = module.distribute_data_input(
                batch, distribution.get_data_layout(batch.shape), "batch"
            )
            assert not placed.sharding.is_fully_replicated
        placed = module.distribute_data_input(odd, distribution.get_data_layout(odd.shape), "batch")

    assert calls[0] is numpy_batch and calls[1] is jax_batch and len(calls) == 2
    assert placed.sharding.is_fully_replicated


def test_with_several_processes_keras_places_the_batch_and_an_indivisible_one_raises(
    monkeypatch,
):
    module, calls = _spied_placement(monkeypatch)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    even = np.ones((4, 2), "float32")
    odd = np.ones((3, 2), "float32")

    with _jax_compat.uneven_batches_replicated():
        module.distribute_data_input(even, distribution.get_data_layout(even.shape), "batch")
        with pytest.raises(ValueError, match="A batch of 3 samples .* 2 processes .* divisible by 2"):
            module.distribute_data_input(odd, distribution.get_data_layout(odd.shape), "batch")

    assert calls == [even]


def test_losses_override_is_what_model_losses_reads():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert model._losses_override == []
    penalty = keras.ops.ones(())
    with _jax_compat.losses_override(model, [penalty]):
        assert model.losses == [penalty]
    assert model.losses == []


def test_fit_reads_the_epoch_logs_through_the_overridden_method():
    fit = inspect.getsource(keras_jax_trainer.JAXTrainer.fit)
    assert "self.jax_state_sync()" in fit
    assert fit.index("self.jax_state_sync()") < fit.index("self._get_metrics_result_or_logs(logs)")
    assert fit.index("self._get_metrics_result_or_logs(logs)") < fit.index("self.evaluate(")


def test_the_step_state_is_built_from_metrics_variables():
    source = inspect.getsource(keras_jax_trainer.JAXTrainer._get_jax_state)
    assert "self.metrics_variables" in source
    sync = inspect.getsource(keras_jax_trainer.JAXTrainer.jax_state_sync)
    assert "zip(self.metrics_variables, metrics_variables)" in sync


def test_keras_looks_up_its_epoch_iterator_in_the_trainer_module_at_each_call():
    iterator = _jax_compat.epoch_iterator_class()
    assert iterator is keras_jax_trainer.JAXEpochIterator
    for method in ("fit", "evaluate", "predict"):
        source = inspect.getsource(getattr(keras_jax_trainer.JAXTrainer, method))
        assert "JAXEpochIterator(" in source, method
    # What SharedEpochIterator overrides and reads.
    assert _parameters(iterator._get_distributed_iterator) == ["self", "distribution"]
    assert "self._get_distributed_iterator(distribution)" in inspect.getsource(iterator._get_iterator)
    enumerate_source = inspect.getsource(iterator._enumerate_iterator)
    assert "self._num_batches" in enumerate_source
    assert "self._num_batches = self.data_adapter.num_batches" in inspect.getsource(iterator.reset)

    class Replacement(iterator):
        pass

    with _jax_compat.epoch_iterator_replaced(Replacement):
        with _jax_compat.epoch_iterator_replaced(Replacement):  # re-entrant
            assert keras_jax_trainer.JAXEpochIterator is Replacement
    assert keras_jax_trainer.JAXEpochIterator is iterator


@pytest.mark.parametrize("placed", [False, True], ids=["cpu", "accelerator"])
def test_keras_s_epoch_iterator_reads_each_batch_from_its_adapter_s_get_jax_iterator(
    placed, monkeypatch
):
    if placed:  # Keras places each batch on the device, one step ahead.
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = np.arange(40, dtype="float32").reshape(10, 4)
    iterator = _jax_compat.epoch_iterator_class()(x=x, y=x[:, :1], batch_size=4, shuffle=False)
    assert _jax_compat.host_batches_are_fresh(iterator)
    pulled = []
    _jax_compat.record_host_batches(iterator, pulled.append)
    yielded = []
    for _ in range(2):
        with iterator.catch_stop_iteration():
            for *_, batches in iterator:  # (begin, end, it); Keras 3.10: (step, it)
                yielded.append(next(batches))
        iterator.reset()
    assert [len(b[0]) for b in pulled] == [4, 4, 2] * 2
    assert all(isinstance(b[0], np.ndarray) for b in pulled)
    assert [isinstance(b[0], jax.Array) for b in yielded] == [placed] * 6
    for host, device in zip(pulled, yielded):
        np.testing.assert_array_equal(host[0], np.asarray(device[0]))


def test_a_generator_s_batches_are_not_fresh():
    def batches():
        while True:
            yield np.zeros((4, 4), "float32"), np.zeros((4, 1), "float32")

    iterator = _jax_compat.epoch_iterator_class()(x=batches(), steps_per_epoch=2)
    assert not _jax_compat.host_batches_are_fresh(iterator)
    assert _jax_compat.reads_generator_or_py_dataset(iterator)


def test_keras_s_adapters_for_a_py_dataset_and_for_arrays_are_told_apart():
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return np.zeros((4, 4), "float32"), np.zeros((4, 1), "float32")

    make = _jax_compat.epoch_iterator_class()
    dataset = make(x=Batches())
    arrays = make(x=np.zeros((8, 4), "float32"), y=np.zeros((8, 1), "float32"), batch_size=4)
    assert _jax_compat.reads_generator_or_py_dataset(dataset)
    assert not _jax_compat.host_batches_are_fresh(dataset)
    assert not _jax_compat.reads_generator_or_py_dataset(arrays)


def test_the_coordination_client_and_keras_seed_agreement_exist():
    from jax._src import distributed

    assert hasattr(distributed.global_state, "client")
    assert _jax_compat.coordination_client() is None  # one process: no service
    assert callable(_jax_compat.initialize_rng)
    # The client's methods the watchdog calls (a jaxlib class, present without a run).
    from jax._src.lib import _jax

    methods = dir(_jax.DistributedRuntimeClient)
    assert {"key_value_set", "key_value_try_get"} <= set(methods)
    assert "allow_overwrite" in _jax.DistributedRuntimeClient.key_value_set.__doc__


def test_a_variable_laid_out_later_is_placed_on_the_layout_by_each_assignment():
    variable = keras.Variable(np.arange(4, dtype="float32"))
    assert variable._layout is None
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    layout = distribution.get_variable_layout(variable)

    _jax_compat.lay_out_variable(variable, layout)

    assert variable._layout is layout
    assert variable.value.sharding.is_equivalent_to(layout.backend_layout, 1)
    variable.assign(np.zeros(4, "float32"))
    assert variable.value.sharding.is_equivalent_to(layout.backend_layout, 1)
    np.testing.assert_array_equal(np.array(variable.value), np.zeros(4))


def test_keras_warns_that_the_input_ran_out_through_the_overridden_method(recwarn):
    # InterruptedWarningWhen overrides it; Keras calls it when the data
    # raises StopIteration inside a step.
    import warnings

    import numpy as np

    class Quiet(_jax_compat.InterruptedWarningWhen, _jax_compat.epoch_iterator_class()):
        def input_interrupted(self):
            return False

    def batches():
        for _ in range(2):
            yield np.ones((4, 2), "float32"), np.ones((4, 1), "float32")

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    warnings.simplefilter("always")
    model.fit(batches(), epochs=1, verbose=0)
    assert any("ran out of data" in str(w.message) for w in recwarn)
    recwarn.clear()
    with _jax_compat.epoch_iterator_replaced(Quiet):
        model.fit(batches(), epochs=1, verbose=0)
    assert not any("ran out of data" in str(w.message) for w in recwarn)
    assert hasattr(_jax_compat.epoch_iterator_class(), "_interrupted_warning")


def test_a_variable_keeps_its_creation_layout_and_the_fresh_one_is_the_new_distribution_s():
    import jax

    wide = keras.distribution.DataParallel(devices=jax.devices())
    with wide.scope():
        variable = keras.Variable(np.zeros((4, 2), "float32"))
    narrow = keras.distribution.DataParallel(devices=jax.devices()[:1])
    # Keras answers with the layout the variable was created with...
    assert narrow.get_variable_layout(variable).device_mesh is wide.device_mesh
    # ...the compat function with the one the new distribution gives it.
    fresh = _jax_compat.fresh_variable_layout(narrow, variable)
    assert fresh.device_mesh is narrow.device_mesh
    assert variable._layout.device_mesh is wide.device_mesh  # unchanged


def _sharded_dense_distribution():
    import jax

    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_keras_names_each_optimizer_slot_after_its_variable(optimizer):
    # optimizer_slot_references reads Keras's `add_variable_from_reference` names.
    with _sharded_dense_distribution().scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(6, name="dense_a")(inputs))
        built = (
            keras.optimizers.Adam() if optimizer == "adam" else keras.optimizers.SGD(momentum=0.9)
        )
        built.build(model.trainable_variables)
    references = _jax_compat.optimizer_slot_references(built, model.trainable_variables)
    slots = [v for v in built.variables if id(v) in references]
    per_variable = 2 if optimizer == "adam" else 1
    assert len(slots) == per_variable * len(model.trainable_variables)
    kernel = model.trainable_variables[0]
    assert all(references[id(s)] is kernel for s in slots if tuple(s.shape) == (4, 6))
    # ...and lays each out like its variable (what the references stand for).
    for slot in slots:
        assert slot.value.sharding.spec == references[id(slot)].value.sharding.spec


def test_a_variable_like_another_is_laid_out_as_it_is_from_creation():
    import jax

    with _sharded_dense_distribution().scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(6, name="dense_a")(inputs))
        kernel = model.trainable_variables[0]
        zeros = _jax_compat.variable_like(kernel, "zeros_like_kernel", "float32")
        copy = _jax_compat.variable_like(kernel, "copy_of_kernel", "float32", value=kernel.value)
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    for made in (zeros, copy):
        assert made.value.sharding.spec == kernel.value.sharding.spec
        assert made._layout is kernel._layout  # later assignments are placed there too
    np.testing.assert_array_equal(np.asarray(zeros.value), np.zeros((4, 6)))
    np.testing.assert_array_equal(np.asarray(copy.value), np.asarray(kernel.value))


class _StepState(keras.callbacks.Callback):
    """The type and keys of `_jax_state` after each step (read as `self._model`: no sync)."""

    def on_train_begin(self, logs=None):
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        state = getattr(self._model, "_jax_state", None)
        if state is not None:
            self.seen.append((type(state), sorted(state)))


@pytest.mark.parametrize("safe", [False, True])
def test_keras_puts_each_step_state_on_the_model_and_the_safe_model_keeps_it_untracked(safe):
    from keras_safe_dist import SafeDistributedModel

    inputs = keras.Input((3,))
    model = (SafeDistributedModel if safe else keras.Model)(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    seen = _StepState()
    x = np.ones((12, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, verbose=0, callbacks=[seen])
    keys = ["metrics_variables", "non_trainable_variables", "optimizer_variables",
            "trainable_variables"]
    # Set by Keras's loop after steps 1 and 2 (seen at the next step's start),
    # through the attribute SafeDistributedModel sets without tracking.
    assert _jax_compat.STEP_STATE_ATTRIBUTES == ("_jax_state",)
    assert [k for _, k in seen.seen] == [keys, keys]
    tracked = {t.__name__ for t, _ in seen.seen}
    assert tracked == ({"dict"} if safe else {"TrackedDict"})
    assert model._jax_state is None  # cleared at the end of fit()


def test_a_first_step_that_raises_leaves_keras_s_variables_empty_unless_put_back():
    class Refused(keras.Model):
        def train_step(self, state, data):
            raise ValueError("refused while traced")

    def fit(put_back):
        inputs = keras.Input((3,))
        model = Refused(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        model.make_train_function()
        function = model.train_function

        def train_function(state, iterator):
            try:
                return function(state, iterator)
            except ValueError:
                if put_back:
                    assert _jax_compat.put_back_at_sync(model, state)
                raise

        model.train_function = train_function
        model.make_train_function = lambda force=False: model.train_function
        x = np.ones((4, 3), "float32")
        with pytest.raises(ValueError, match="refused while traced"):
            model.fit(x, x[:, :1], batch_size=4, verbose=0)
        return [v._value is not None for v in model.trainable_variables]

    # Keras took the values off the model for the step, and puts back only a step's result.
    assert fit(put_back=False) == [False, False]
    assert fit(put_back=True) == [True, True]
