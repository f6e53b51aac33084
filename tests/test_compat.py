"""Fails loudly when a Keras release changes a private API keras_safe_dist relies on."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.backend.tensorflow import trainer as tf_trainer

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import _compat
from keras_safe_dist.backend.tensorflow import _compat as _tf_compat

from conftest import strategy_for


def parameters(function):
    return list(inspect.signature(function).parameters)


def test_loss_reduction_helpers_keep_their_signatures():
    assert parameters(_compat.reduce_weighted_values) == ["values", "sample_weight", "mask", "reduction", "dtype"]
    assert parameters(_compat.apply_mask) == ["sample_weight", "mask", "dtype", "reduction"]
    assert parameters(_compat.squeeze_or_expand_to_same_rank)[:2] == ["x1", "x2"]
    values = keras.ops.convert_to_tensor([[1.0, 2.0], [3.0, 4.0]])
    total = _compat.reduce_weighted_values(values, None, None, "sum", "float32")
    assert float(total) == 10.0


def test_compile_loss_flat_losses_can_be_swapped():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(loss="mse", loss_weights=3.0)
    compiled = _compat.compile_loss(model)
    y = np.ones((4, 1), "float32")
    compiled(y, y)
    assert compiled._flat_losses[0]._fields == ("path", "loss", "loss_weights", "name")
    with _compat.swapped_loss_functions(compiled, lambda i, fn, w: lambda *a: keras.ops.convert_to_tensor(5.0)):
        assert float(compiled(y, y)) == 15.0
    assert float(compiled(y, y)) == 0.0


def test_per_output_loss_metrics_take_the_given_weight():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(inputs), "b": keras.layers.Dense(1, name="b")(inputs)})
    model.compile(loss={"a": "mse", "b": "mae"})
    compiled = _compat.compile_loss(model)
    y = {"a": np.ones((4, 1), "float32"), "b": np.ones((4, 1), "float32")}
    pred = {"a": np.full((4, 1), 3.0, "float32"), "b": np.zeros((4, 1), "float32")}
    compiled(y, pred)  # builds the per-output metrics
    metrics = [m for m in compiled.metrics if m is not None]
    assert [m.name for m in metrics] == ["a_loss", "b_loss"]
    for metric in metrics:
        metric.reset_state()
    with _compat.per_output_loss_weight(compiled, keras.ops.convert_to_tensor(5.0)):
        compiled(y, pred)
    # Keras's own weight is the static batch size, 4.
    assert [float(m.count) for m in metrics] == [5.0, 5.0]
    assert [float(m.result()) for m in metrics] == [4.0, 1.0]
    assert all("update_state" not in vars(m) for m in metrics)


def test_loss_tracker_is_the_logged_mean():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(loss="mse")
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    assert tracker.name == "loss"
    assert model.metrics[0] is tracker


def test_logs_are_flattened_as_train_on_batch_returns_them():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    logs = model.train_on_batch(x, y, return_dict=True)
    # The compiled metrics in their order, then other keys sorted; one value alone.
    assert _compat.flatten_metrics_in_order(model, {**logs, "b": 2.0, "a": 1.0}) == [
        logs["loss"], logs["mae"], 1.0, 2.0
    ]
    assert _compat.flatten_metrics_in_order(model, {"loss": 0.5}) == 0.5


def test_compute_loss_override_is_detected():
    class Custom(SafeDistributedModel):
        def compute_loss(self, *args, **kwargs):
            return 0.0

    assert not _compat.compute_loss_is_overridden(SafeDistributedModel())
    assert _compat.compute_loss_is_overridden(Custom())


def test_keras_mask_is_read_from_tensors():
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(np.array([[0, 1]]))
    np.testing.assert_array_equal(_compat.keras_mask(embedded).numpy(), [[False, True]])
    assert _compat.keras_mask(tf.ones(2)) is None


def test_optimizer_skips_its_all_reduce_when_told():
    source = inspect.getsource(tf_optimizer.TFOptimizer._backend_update_step)
    assert "self._all_reduce_sum_gradients(" in source
    strategy = strategy_for(2)
    with strategy.scope():
        variable = keras.Variable(np.zeros(2, "float32"))
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([variable])

    @tf.function
    def step(reduced):
        def apply():
            optimizer.apply([tf.constant([1.0, 2.0])], [variable])

        if reduced:
            with _tf_compat.gradients_already_reduced(optimizer):
                strategy.extended.call_for_each_replica(apply)
        else:
            strategy.extended.call_for_each_replica(apply)

    with strategy.scope():
        step(False)
        np.testing.assert_allclose(variable.numpy(), [-2.0, -4.0])
        step(True)
        np.testing.assert_allclose(variable.numpy(), [-3.0, -6.0])
    assert "_all_reduce_sum_gradients" not in vars(optimizer)


def test_trainer_hooks_exist_and_fit_calls_them():
    assert parameters(tf_trainer.TensorFlowTrainer._maybe_symbolic_build) == ["self", "iterator", "data_batch"]
    assert "data_batch" in parameters(keras.Model._symbolic_build)
    assert parameters(keras.Model._get_metrics_result_or_logs) == ["self", "logs"]
    fit = inspect.getsource(tf_trainer.TensorFlowTrainer.fit)
    assert "self._maybe_symbolic_build(iterator=epoch_iterator)" in fit
    assert "self._get_metrics_result_or_logs(logs)" in fit
    assert issubclass(_compat.Functional, keras.Model)
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1)(inputs)
    assert type(keras.Model(inputs=inputs, outputs=outputs)) is _compat.Functional


def test_initial_epoch_set_on_the_model_is_where_fit_starts():
    source = inspect.getsource(tf_trainer.TensorFlowTrainer.fit)
    assert "initial_epoch = self._initial_epoch or initial_epoch" in source
    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    _compat.set_initial_epoch(model, 2)
    history = model.fit(np.ones((4, 1)), np.ones((4, 1)), epochs=3, verbose=0)
    assert history.epoch == [2]
    _compat.set_initial_epoch(model, None)
    assert model.fit(np.ones((4, 1)), np.ones((4, 1)), epochs=3, verbose=0).epoch == [0, 1, 2]


def test_clone_model_builds_a_functional_clone_from_the_class_and_options_are_copied():
    from keras.src.models import cloning

    assert "_clone_functional_model(" in inspect.getsource(cloning.clone_model)
    original = cloning._clone_functional_model._safe_dist_copy_options
    assert "model.__class__(\n            input_tensors, output_tensors, name=model.name\n        )" in (
        inspect.getsource(inspect.unwrap(cloning._clone_functional_model))
    )
    seen = []
    _compat.copy_options_on_clone(lambda model, clone: seen.append(clone))  # installed once
    assert cloning._clone_functional_model._safe_dist_copy_options is original
    inputs = keras.Input((2,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), clipvalue=0.5)
    assert keras.models.clone_model(model).clipvalue == 0.5
    assert seen == []


def test_strategy_accessors_name_the_strategy_of_models_and_variables():
    strategy = strategy_for(2)
    default = _tf_compat.default_strategy()
    assert default is tf.distribute.get_strategy()
    assert not tf.distribute.has_strategy()
    with strategy.scope():
        inside = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    outside = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert _compat.model_strategy(inside) is strategy
    assert _compat.model_strategy(outside) is None
    kernel = inside.layers[0].kernel.value
    assert isinstance(kernel, tf.distribute.DistributedValues)
    assert _tf_compat.distributed_strategy(kernel) is strategy


def test_flatten_layers_reaches_nested_layers():
    inner = keras.Sequential([keras.layers.Dense(2, name="inner_dense")], name="inner")
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(inner(inputs)))
    names = [layer.name for layer in _compat.flatten_layers(model)]
    assert "inner_dense" in names and "head" in names and "inner" in names
    assert model.name not in names


def test_fit_remembers_one_replicas_batch_specs():
    with strategy_for(2).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    assert _tf_compat.train_data_specs(model) is None
    model.fit(np.ones((6, 3), "float32"), np.ones((6, 1), "float32"), batch_size=6, verbose=0)
    x, y = _tf_compat.train_data_specs(model)
    assert (x.shape, x.dtype, y.shape) == ((None, 3), "float32", (None, 1))


def test_tensorflow_batch_hooks_run_synchronously_on_python_logs():
    # NaNOnsetDetector reads each step's logs in on_train_batch_end without
    # adding a host sync only because Keras's TensorFlow trainer already
    # converts the logs to Python numbers, on the training thread, before any
    # batch hook runs.
    import threading

    from keras.src.backend.tensorflow import core as tf_core

    assert tf_core.IS_THREAD_SAFE is False
    source = inspect.getsource(keras.callbacks.CallbackList._on_train_batch_end)
    assert "pythonify_logs(logs)" in source
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((type(logs["loss"]), threading.current_thread() is threading.main_thread()))

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=[Probe()])
    assert seen == [(float, True), (float, True)]


def test_compute_loss_wrapper_and_training_arg_flag():
    class Doubled(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            # No `training` argument: Keras's wrapper still calls it.
            return 2.0 * keras.ops.mean((y - y_pred) ** 2)

    inputs = keras.Input((2,))
    model = Doubled(inputs, keras.layers.Dense(1)(inputs))
    y = np.ones((4, 1), "float32")
    loss = _compat.compute_loss(model, None, y, np.zeros((4, 1), "float32"), None)
    assert float(loss) == 2.0
    assert _compat.call_has_training_arg(model) is True

    class NoTraining(keras.Model):
        def call(self, x):
            return x

    assert _compat.call_has_training_arg(NoTraining()) is False


def test_unscale_loss_undoes_keras_scaling_under_a_strategy():
    with strategy_for(2).scope():
        assert float(_compat.unscale_loss(tf.constant(1.5))) == 3.0
    assert float(_compat.unscale_loss(tf.constant(1.5))) == 1.5


def test_dataset_specs_give_one_replica_share_with_unknown_batch():
    strategy = strategy_for(2)
    data = tf.data.Dataset.from_tensor_slices(
        ({"x": np.ones((6, 3), "float32")}, np.ones((6, 1), "int32"))
    ).batch(4)
    spec = strategy.experimental_distribute_dataset(data).element_spec
    specs = tf.nest.map_structure(_tf_compat._spec_tensor, spec)
    assert specs[0]["x"].shape == (None, 3) and specs[0]["x"].dtype == "float32"
    assert specs[1].shape == (None, 1) and specs[1].dtype == "int32"
    optional = tf.OptionalSpec(tf.TensorSpec((None, 2), tf.float32))
    assert _tf_compat._spec_tensor(optional).shape == (None, 2)
    assert _tf_compat._spec_tensor(tf.OptionalSpec(tf.type_spec_from_value(None))) is None
    sparse = _tf_compat._spec_tensor(tf.SparseTensorSpec([None, 5], tf.float32))
    assert sparse.sparse and sparse.shape == (None, 5)


def test_tf_epoch_iterator_exposes_its_distributed_dataset():
    iterator = tf_trainer.TFEpochIterator(
        x=np.ones((4, 2), "float32"), batch_size=2, distribute_strategy=strategy_for(2)
    )
    spec = iterator._get_iterator().element_spec
    assert _tf_compat._spec_tensor(spec).shape == (None, 2)


def test_trainer_builds_its_step_functions_through_make_function():
    # SafeDistributedModel's multi-step function replaces this one method.
    assert parameters(tf_trainer.TensorFlowTrainer._make_function) == ["self", "step_function"]
    assert parameters(tf_trainer.reduce_per_replica) == ["values", "strategy", "reduction"]
    source = inspect.getsource(tf_trainer.TensorFlowTrainer.make_train_function)
    assert "self._make_function(self.train_step)" in source


def test_synchronized_moments_function_keeps_its_signature_and_result():
    # `padding_left_out_of_synchronized_moments` replaces Keras's
    # `_compute_moments_sync(x, axes, keepdims)`: a Keras release that renames
    # it or changes its arguments fails here, not silently in training.
    from keras.src.backend.tensorflow import nn as tf_nn

    stock = _tf_compat._stock_moments_sync
    assert list(inspect.signature(stock).parameters) == ["x", "axes", "keepdims"]
    assert tf_nn._compute_moments_sync in (stock, _tf_compat._moments_sync_without_padding)
    x = tf.constant(np.random.default_rng(0).normal(size=(5, 3)), tf.float32)

    def moments(rows):
        with _tf_compat.padding_left_out_of_synchronized_moments(rows):
            return keras.ops.moments(x, axes=[0], synchronized=True)

    strategy = strategy_for(2)

    def replica():
        return moments(tf.constant(0)), moments(tf.constant(1))

    results = strategy.run(tf.function(replica))
    kept, dropped = keras.tree.map_structure(
        lambda t: strategy.experimental_local_results(t)[0].numpy(), results
    )
    np.testing.assert_allclose(kept[0], x.numpy().mean(0), rtol=1e-5)
    np.testing.assert_allclose(kept[1], x.numpy().var(0), rtol=1e-4)
    np.testing.assert_allclose(dropped[0], x.numpy()[:4].mean(0), rtol=1e-5)
    np.testing.assert_allclose(dropped[1], x.numpy()[:4].var(0), rtol=1e-4)


def test_optional_carried_by_a_while_loop_takes_its_spec_once_traced():
    # The multi-step function carries its logs so, tracing the step once.
    @tf.function(autograph=False)
    def last_square(limit):
        empty = tf.experimental.Optional.empty(None)

        def body(i, outputs):
            value = tf.experimental.Optional.from_value({"square": i * i})
            _tf_compat.set_optional_spec(empty, value.element_spec)
            return i + 1, value

        _, outputs = tf.while_loop(lambda i, outputs: i < limit, body, (tf.constant(0), empty))
        _tf_compat.set_optional_spec(outputs, empty.element_spec)
        return outputs

    assert int(last_square(tf.constant(4)).get_value()["square"]) == 9
    assert not bool(last_square(tf.constant(0)).has_value())


def counting(base):
    class Counted(base):
        traces = 0

        def train_step(self, data):
            type(self).traces += 1  # at trace time: once per replica per trace
            return super().train_step(data)

    return Counted


def train_step_traces(base, replicas, callbacks=(), **compile_options):
    model_class = counting(base)
    with strategy_for(replicas).scope():
        inputs = keras.Input((4,))
        model = model_class(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse", **compile_options)
    x = np.random.default_rng(0).normal(size=(44, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=list(callbacks))
    return model_class.traces


def test_several_steps_per_execution_trace_the_step_as_often_as_stock(replicas):
    # Stock Keras cannot run steps_per_execution=4 on two replicas; its one-step
    # function traces the step once per replica (and once per input signature).
    stock = train_step_traces(keras.Model, replicas)
    assert stock == replicas
    assert train_step_traces(SafeDistributedModel, replicas, steps_per_execution=4) == stock
    # With a NaNOnsetDetector an execution can end early: the loop runs on one
    # replica too.
    from keras_safe_dist.callbacks import NaNOnsetDetector

    detected = train_step_traces(
        SafeDistributedModel, replicas, [NaNOnsetDetector()], steps_per_execution=4
    )
    assert detected == stock


def test_variable_creator_scopes_are_counted_on_this_thread():
    outside = _tf_compat.variable_creator_count()
    with tf.variable_creator_scope(lambda next_creator, **kwargs: next_creator(**kwargs)):
        assert _tf_compat.variable_creator_count() == outside + 1
        with strategy_for(2).scope():
            assert _tf_compat.variable_creator_count() >= outside + 2
    assert _tf_compat.variable_creator_count() == outside


def test_activity_penalty_convention_is_the_installed_keras_one():
    # keras 3.14 started dividing activity penalties by the batch size; the
    # probe must find what a model's own layers do.
    inputs = keras.Input((2,))
    model = keras.Model(
        inputs, keras.layers.Dense(1, kernel_initializer="ones", activity_regularizer=keras.regularizers.L1(1.0))(inputs)
    )
    model(np.ones((4, 2), "float32"))
    summed = 4 * 2.0
    expected = summed / 4 if _compat.activity_penalty_per_sample() else summed
    assert [float(x) for x in model.losses] == [expected]


def test_activity_losses_are_the_regularized_layers_own_losses():
    class AddsLoss(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x) * 0.0 + 7.0)
            return x

    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(2, activity_regularizer=keras.regularizers.L2(1.0))(inputs)
    model = keras.Model(inputs, AddsLoss()(hidden))
    model(np.ones((3, 2), "float32"))
    activity = _compat.activity_losses(model)
    assert len(model.losses) == 2 and len(activity) == 1
    assert activity[0] is not None and float(activity[0]) != 7.0
    assert any(x is activity[0] for x in model.losses)


def test_keras_runs_an_adapter_of_unknown_length_until_the_data_ends():
    # Per-worker data (backend/tensorflow/_per_worker.py): Keras takes a
    # DataAdapter given as `x` as it is, and runs each epoch of an adapter
    # whose `num_batches` is None until the iterator has no batch left.
    from keras.src.trainers import data_adapters
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    assert parameters(data_adapters.get_data_adapter) == [
        "x", "y", "sample_weight", "batch_size", "steps_per_epoch", "shuffle", "class_weight",
    ]
    for name in ("get_tf_dataset", "get_numpy_iterator", "num_batches", "batch_size",
                 "has_partial_batch", "partial_batch_size", "on_epoch_begin", "on_epoch_end"):
        assert hasattr(DataAdapter, name), name
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.arange(10, dtype="float32")[:, None], np.ones((10, 1), "float32"))
    ).batch(4)
    own = _tf_compat.data_adapter(dataset, None, None, None, False, None)
    assert own.num_batches == 3 and own.get_tf_dataset() is dataset
    adapter = _tf_compat.UnknownLengthAdapter(own)
    assert data_adapters.get_data_adapter(adapter) is adapter

    class Steps(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.steps, self.batches = self.params["steps"], []

        def on_epoch_begin(self, epoch, logs=None):
            self.batches.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.batches[-1] += 1

    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    steps = Steps()
    with pytest.warns(UserWarning) as caught:
        model.fit(adapter, epochs=2, verbose=0, callbacks=[steps])
    assert steps.steps is None and steps.batches == [3, 3]
    # The warning Keras gives where such an epoch ends, silenced by _per_worker.
    assert any(str(w.message).startswith(_tf_compat.RAN_OUT_OF_DATA) for w in caught)
    # Every batch evaluated: the loss of the whole dataset.
    with pytest.warns(UserWarning, match=_tf_compat.RAN_OUT_OF_DATA):
        loss = model.evaluate(adapter, verbose=0)
    assert loss == pytest.approx(model.evaluate(dataset, verbose=0))


def test_distributed_dataset_knows_the_dataset_it_was_made_from():
    strategy = strategy_for(2)
    dataset = tf.data.Dataset.range(4).batch(2)
    assert _tf_compat.distributed_source(strategy.experimental_distribute_dataset(dataset)) is dataset
    from_function = strategy.distribute_datasets_from_function(lambda _: dataset)
    assert _tf_compat.distributed_source(from_function) is None


def test_a_traced_tensor_is_told_same_for_every_sample_only_when_no_data_reaches_it():
    from keras_safe_dist.backend.tensorflow import _compat as _tf_compat

    constant = tf.constant([[0, 1, 2]])  # captured from outside, as a layer's built ids
    found = {}

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
    def step(ids):
        found["data"] = _tf_compat.same_for_every_sample(tf.reshape(ids, [-1]))
        found["range"] = _tf_compat.same_for_every_sample(tf.range(3) + 1)
        found["captured"] = _tf_compat.same_for_every_sample(tf.reshape(constant, [-1]))
        # A shape TensorFlow does not know when tracing comes from the data.
        found["dynamic shape"] = _tf_compat.same_for_every_sample(tf.range(tf.shape(ids)[1]))
        return ids

    step(tf.constant([[3, 4, 5]]))
    assert found == {"data": False, "range": True, "captured": True, "dynamic shape": False}
    assert _tf_compat.same_for_every_sample(tf.constant([1])) is False  # eager: nothing to walk


def test_instance_functions_are_counted_apart_by_tensorflows_retracing_warning():
    # TensorFlow keys its retracing count by code object (a private method):
    # two instances' bound methods share a key, their instance_function don't.
    class Engine:
        def step(self):
            return tf.constant(1.0)

    first, second = Engine(), Engine()
    shared = [tf.function(engine.step)._get_key_for_call_stats() for engine in (first, second)]
    assert shared[0] is shared[1] is Engine.step.__code__
    apart = [
        _tf_compat.instance_function(engine.step)._get_key_for_call_stats()
        for engine in (first, second)
    ]
    assert apart[0] is not apart[1]
    assert float(_tf_compat.instance_function(first.step, jit_compile=False)()) == 1.0
