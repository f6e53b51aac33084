"""SafeDistributedModel's wrapping, compile, saving, data checks, evaluate/predict and logs
(its options: test_options.py)."""

import os
import re
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_safe_dist import SafeDistributedFunctional
from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.model._callbacks import EpochBoundary

from conftest import regression_data
from conftest import strategy_for


def functional(**options):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(3, activation="tanh")(inputs))
    return SafeDistributedModel(inputs=inputs, outputs=outputs, **options)


@keras.saving.register_keras_serializable(package="keras_safe_dist_tests")
class TwoLayer(SafeDistributedModel):
    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_jit_compile_on_two_replicas_compiles_each_replica_and_auto_stays_off():
    with strategy_for(2).scope():
        model = functional()
        model.compile(optimizer="sgd", loss="mse")
        assert model.jit_compile is False and model._xla_replicas is False
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        assert model.jit_compile is False and model._xla_replicas is True
        assert model.replica_jit_compile is True
        model.compile(optimizer="sgd", loss="mse", jit_compile="auto")
        assert model.replica_jit_compile is False
    with pytest.raises(AttributeError):
        model.replica_jit_compile = True


def test_replica_jit_compile_on_one_device_for_an_embedding_with_accumulation():
    tokens = keras.Input((3,), dtype="int32")
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Embedding(10, 2)(tokens)))
    model = SafeDistributedModel(tokens, outputs, gradient_accumulation_steps=2)
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert (model.jit_compile, model.replica_jit_compile) == (False, True)


def test_xla_dropped_for_a_nan_detector_is_said_once_and_read_as_false():
    from keras_safe_dist.callbacks import NaNOnsetDetector

    x, y, _ = regression_data(16)
    with strategy_for(2).scope():
        model = functional()
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.fit(x, y, batch_size=8, verbose=0, callbacks=[NaNOnsetDetector()])
    dropped = [w for w in caught if "asked for XLA" in str(w.message)]
    assert [w.filename for w in dropped] == [__file__]
    assert str(dropped[0].message).startswith(
        "compile(jit_compile=True) asked for XLA, but with a NaNOnsetDetector (its in-step "
        f"checks run in the plain step) model '{model.name}' trains with the plain step, without XLA"
    )
    assert model.replica_jit_compile is False


def test_replica_jit_compile_is_false_for_an_overridden_compute_loss():
    class OwnLoss(SafeDistributedModel):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean((y - y_pred) ** 2)

    with strategy_for(2).scope():
        inputs = keras.Input((4,))
        model = OwnLoss(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", jit_compile=True)
    assert model._xla_replicas is True and model.replica_jit_compile is False


def test_jit_compile_on_two_replicas_refuses_synchronized_layers():
    with strategy_for(2).scope():
        inputs = keras.Input((4,))
        norm = keras.layers.BatchNormalization(synchronized=True, name="synced")(inputs)
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(norm))
        with pytest.raises(ValueError, match=r"Received: synchronized layers \['synced'\] with jit_compile=True"):
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)


def test_functional_form_returns_functional_subclass():
    model = functional(gradient_accumulation_steps=2)
    assert isinstance(model, SafeDistributedFunctional)
    assert isinstance(model, SafeDistributedModel)
    assert model.gradient_accumulation_steps == 2


def test_wraps_a_sequential_model():
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model = SafeDistributedModel(inputs=sequential.inputs, outputs=sequential.outputs, clipvalue=0.5)
    assert model.clipvalue == 0.5
    assert len(model.trainable_weights) == 2


def _sequential_with_input():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])


def _sequential_built():
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])
    model.build((None, 4))
    return model


def _sequential_unbuilt():
    return keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])


def _functional_stock():
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(3)(inputs)))


@pytest.mark.parametrize(
    "build",
    [_sequential_with_input, _sequential_built, _sequential_unbuilt, _functional_stock],
    ids=["sequential-input", "sequential-built", "sequential-unbuilt", "functional"],
)
def test_from_model_keeps_layers_weights_predictions_and_options(build):
    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    original = build()
    shape = (4,) if build is _sequential_unbuilt else None
    model = SafeDistributedModel.from_model(
        original, input_shape=shape, gradient_accumulation_steps=2, global_clipnorm=1.5
    )
    assert isinstance(model, SafeDistributedFunctional)
    assert (model.gradient_accumulation_steps, model.global_clipnorm) == (2, 1.5)
    assert model.name == original.name
    assert [id(v) for v in model.weights] == [id(v) for v in original.weights]
    np.testing.assert_array_equal(
        model.predict(x, verbose=0), original.predict(x, verbose=0)
    )


def test_from_model_trains_the_original_layers_under_a_strategy():
    strategy = strategy_for(2)
    x, y, _ = regression_data(8)
    with strategy.scope():
        original = keras.Sequential([keras.layers.Dense(1)])
        model = SafeDistributedModel.from_model(original, input_shape=(4,), clipnorm=1.0)
        model.compile(optimizer="sgd", loss="mse")
    before = original.get_weights()[0].copy()
    model.fit(x, y, batch_size=4, verbose=0)
    assert isinstance(original.weights[0].value, tf.distribute.DistributedValues)
    assert not np.allclose(original.get_weights()[0], before)


def test_from_model_refuses_an_unbuilt_sequential_without_a_shape():
    with pytest.raises(ValueError, match=r"has no `Input` and was never built\. Pass the shape of one sample, e\.g\. `SafeDistributedModel\.from_model\(model, input_shape=\(8,\)\)`"):
        SafeDistributedModel.from_model(_sequential_unbuilt())


def test_from_model_refuses_an_input_shape_that_differs_from_the_model():
    with pytest.raises(ValueError, match=r"`input_shape` must match .* \(4,\) per sample\. Received: input_shape=\(5,\)"):
        SafeDistributedModel.from_model(_sequential_with_input(), input_shape=(5,))


@pytest.mark.parametrize("input_shape", [4, (4.0,), (0,), "4", (True,)])
def test_from_model_refuses_an_input_shape_that_is_not_a_shape(input_shape):
    with pytest.raises(TypeError, match=rf"a tuple of positive integers .* Received: input_shape={re.escape(repr(input_shape))}\. For samples of 8 features pass input_shape=\(8,\)"):
        SafeDistributedModel.from_model(_sequential_unbuilt(), input_shape=input_shape)


@pytest.mark.parametrize(
    "received,message",
    [
        ("model.keras", "takes a keras.Model .* Received: str 'model.keras'"),
        (TwoLayer, "Received: a subclassed model of class TwoLayer, which has none. Subclass SafeDistributedModel"),
    ],
    ids=["not-a-model", "subclassed"],
)
def test_from_model_refuses_what_it_cannot_wrap_naming_it(received, message):
    if received is TwoLayer:
        received = TwoLayer()
        received(np.zeros((1, 4), "float32"))
    with pytest.raises(TypeError, match=message):
        SafeDistributedModel.from_model(received)


def test_from_model_in_a_scope_on_a_model_built_outside_raises_scope_error():
    from keras_safe_dist import ScopeError

    original = _sequential_with_input()
    with strategy_for(2).scope():
        with pytest.raises(ScopeError, match=r"\[SCOPE001\] model '.*': 4 of 4 variables belong to no strategy"):
            SafeDistributedModel.from_model(original)


@pytest.mark.parametrize("build", [functional, TwoLayer], ids=["functional", "subclassed"])
def test_save_and_load_round_trip(tmp_path, build):
    x, y, _ = regression_data(16)
    model = build(
        gradient_accumulation_steps=3, clipnorm=0.5, skip_nonfinite=False,
        accumulation_dtype="bfloat16",
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=4, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compile() was not called" warning
        loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    assert loaded.compiled and loaded.optimizer.get_config() == model.optimizer.get_config()
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(restored.numpy(), saved.numpy())
    assert loaded.gradient_accumulation_steps == 3
    assert loaded.clipnorm == 0.5
    assert loaded.global_clipnorm is None
    assert loaded.skip_nonfinite is False
    assert loaded.accumulation_dtype == "bfloat16"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_evaluate_and_predict_match_stock(replicas):
    x, y, w = regression_data(33)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    stock = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    stock.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    with strategy_for(replicas).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        model.set_weights(stock.get_weights())
    expected = stock.evaluate(x, y, sample_weight=w, batch_size=33, return_dict=True, verbose=0)
    results = model.evaluate(x, y, sample_weight=w, batch_size=16, return_dict=True, verbose=0)
    assert set(results) == set(expected) == {"loss", "mae"}
    assert results["mae"] == pytest.approx(expected["mae"], rel=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0), stock.predict(x, verbose=0), rtol=1e-5)


def test_logs_report_grad_norm_clip_rate_skips_and_samples(replicas):
    x, y, _ = regression_data(48)
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    stock = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    stock.compile(loss="mse")
    with strategy_for(replicas).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(
            inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=2, global_clipnorm=1e-3,
            log_update_stats=True,
        )
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        model.set_weights(stock.get_weights())
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y[32:], stock(x[32:]))
        loss = keras.ops.mean(loss)
    expected_norm = tf.linalg.global_norm(tape.gradient(loss, stock.trainable_weights))
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert history["samples_per_update"] == [16.0, 16.0]
    assert history["clip_rate"] == [1.0, 1.0]
    assert history["skipped_updates"] == [0.0, 0.0]
    assert history["grad_norm"][-1] == pytest.approx(float(expected_norm), rel=1e-5)


def test_callback_overrides_no_batch_hook():
    # A batch hook would make Keras sync with the host after every batch.
    for hook in ("on_train_batch_begin", "on_train_batch_end", "on_batch_end"):
        assert getattr(EpochBoundary, hook) is getattr(keras.callbacks.Callback, hook)


def test_user_callbacks_still_run_and_see_logs():
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(sorted(logs))

    x, y, _ = regression_data(16)
    model = functional()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[Record()])
    assert seen == [["loss"]]


def test_options_assigned_after_a_fit_train_as_a_model_built_with_them(replicas):
    x, y, _ = regression_data(40)
    with strategy_for(replicas).scope():
        keras.utils.set_random_seed(3)
        assigned = functional()
        assigned.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    assigned.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # traces the step
    with strategy_for(replicas).scope():
        fresh = functional(
            gradient_accumulation_steps=2, global_clipnorm=0.01, accumulation_dtype="bfloat16"
        )
        fresh.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    fresh.set_weights(assigned.get_weights())
    start = assigned.get_weights()
    assigned.gradient_accumulation_steps = 2
    assigned.global_clipnorm = 0.01
    assigned.accumulation_dtype = "bfloat16"
    for model in (assigned, fresh):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        sums = model._update_engine.sums.dense
        assert {s.variable.dtype.name for s in sums} == {"bfloat16"}
    # Three clipped updates: each moves the weights by at most 0.5 * 0.01.
    moved = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(assigned.get_weights(), start)))
    assert 0 < moved <= 3 * 0.5 * 0.01 + 1e-6
    for a, b in zip(assigned.get_weights(), fresh.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(assigned.optimizer.iterations.numpy()) == 5 + 3  # one update per batch, then per 2


def test_assigning_an_option_applies_a_pending_group_with_the_options_it_began_under():
    x, y, _ = regression_data(8)
    model = functional(gradient_accumulation_steps=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(x, y)  # half a group: no update yet
    assert int(model.optimizer.iterations.numpy()) == 0
    model.clipvalue = 1e-3
    assert int(model.optimizer.iterations.numpy()) == 1
    before = model.get_weights()
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)  # a whole group under the new clipvalue
    step = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), before))
    assert int(model.optimizer.iterations.numpy()) == 2
    assert step == pytest.approx(0.1 * 1e-3, rel=1e-3)  # float32 weights near 1


@pytest.mark.parametrize("build", [functional, TwoLayer], ids=["functional", "subclassed"])
def test_clone_model_keeps_every_option_and_trains_alike(build):
    options = {
        "gradient_accumulation_steps": 2, "global_clipnorm": 0.01,
        "skip_nonfinite": False, "log_update_stats": True,
    }
    x, y, _ = regression_data(16)
    model = build(**options)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    model(x[:1])
    clone = keras.models.clone_model(model)
    assert type(clone) is type(model)
    assert {name: getattr(clone, name) for name in options} == options
    assert (clone.clipnorm, clone.clipvalue) == (None, None)
    clone.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    clone(x[:1])
    clone.set_weights(model.get_weights())
    histories = [m.fit(x, y, batch_size=4, shuffle=False, verbose=0).history for m in (model, clone)]
    assert histories[0]["clip_rate"] == histories[1]["clip_rate"] == [1.0]
    assert histories[0]["samples_per_update"] == histories[1]["samples_per_update"] == [8.0]
    for a, b in zip(model.get_weights(), clone.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_compile_without_an_optimizer_serves_evaluate_and_predict_and_refuses_training():
    x, y, _ = regression_data(8)
    model = functional()
    model.compile(optimizer=None, loss="mse")  # as stock Keras: evaluate, predict, summary
    stock = keras.Model(model.inputs, model.outputs)
    stock.compile(optimizer=None, loss="mse")
    assert model.compiled and model.optimizer is None
    assert model.evaluate(x, y, verbose=0) == pytest.approx(stock.evaluate(x, y, verbose=0))
    np.testing.assert_array_equal(model.predict(x, verbose=0), stock.predict(x, verbose=0))
    before = model.get_weights()
    for train in (lambda: model.fit(x, y, verbose=0), lambda: model.train_on_batch(x, y)):
        with pytest.raises(ValueError) as error:
            train()
        assert "needs an optimizer: every update is applied with it. Received: " in str(error.value)
        assert "compile(optimizer=None)" in str(error.value)
    assert str(error.value).startswith("SafeDistributedModel.train_on_batch() needs an optimizer")
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("data", ["arrays", "take(0)"])
def test_fit_evaluate_and_predict_on_data_without_samples_raise(steps, data):
    model = functional(gradient_accumulation_steps=steps)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((0, 4), "float32"), np.zeros((0, 1), "float32")
    if data == "arrays":
        args, received = (x, y), "x of shape (0, 4)"
    else:
        x, y, _ = regression_data(8)
        args = (tf.data.Dataset.from_tensor_slices((x, y)).batch(4).take(0),)
        received = "a tf.data.Dataset of cardinality 0"
    for method, purpose in (("fit", "train on"), ("evaluate", "evaluate"), ("predict", "predict")):
        with pytest.raises(ValueError) as error:
            getattr(model, method)(*args[:1] if method == "predict" else args, verbose=0)
        message = str(error.value)
        assert message.startswith(
            f"SafeDistributedModel.{method}() received x that holds no samples, "
            f"so there is nothing to {purpose}"
        )
        assert f"Received: {received}" in message
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("method, name", [("fit", "batch_size"), ("fit", "validation_batch_size"), ("evaluate", "batch_size"), ("predict", "batch_size")])
@pytest.mark.parametrize("value", [0, -4, 2.5, "8", True])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(method, name, value):
    model = functional()
    model.compile(optimizer="sgd", loss="mse")
    x, y, _ = regression_data(8)
    args = (x,) if method == "predict" else (x, y)
    with pytest.raises(ValueError, match=rf"SafeDistributedModel.{method}\(\)'s `{name}` must be an integer >= 1 .* Received: {name}={re.escape(repr(value))}"):
        getattr(model, method)(*args, verbose=0, **{name: value})
    model.predict(x, batch_size=np.int64(4), verbose=0)  # NumPy's integers are integers
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_py_dataset_of_no_batches_and_empty_validation_data_raise_before_a_step():
    model = functional()
    model.compile(optimizer="sgd", loss="mse")
    x, y, _ = regression_data(8)

    class Empty(keras.utils.PyDataset):
        def __len__(self):
            return 0

        def __getitem__(self, index):
            raise IndexError(index)

    with pytest.raises(ValueError, match=r"received x that holds no samples.*Received: a Empty \(a keras.utils.PyDataset\) of 0 batches"):
        model.fit(Empty(), verbose=0)
    for validation in ((x[:0], y[:0]), tf.data.Dataset.from_tensor_slices((x, y)).batch(4).take(0)):
        with pytest.raises(ValueError, match=r"fit\(\) received validation_data that holds no samples, so there is nothing to validate on"):
            model.fit(x, y, validation_data=validation, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_from_model_refuses_a_keyword_that_is_not_an_option():
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError) as error:
        SafeDistributedModel.from_model(sequential, gradient_accumulation=4)
    assert str(error.value).startswith(
        "SafeDistributedModel.from_model() got unexpected keyword arguments "
        "['gradient_accumulation'] (did you mean 'gradient_accumulation_steps'?). "
        "It takes `input_shape` and the options ['accumulation_dtype', 'clipnorm', "
    )
    with pytest.raises(TypeError, match=r"\['seed'\]\. It takes"):
        SafeDistributedModel.from_model(sequential, seed=1)


def test_from_model_keeps_the_options_of_a_safe_distributed_model():
    inputs = keras.Input((3,))
    safe = SafeDistributedModel(
        inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=4, global_clipnorm=1.0,
        skip_nonfinite=False,
    )
    wrapped = SafeDistributedModel.from_model(safe)
    assert (wrapped.gradient_accumulation_steps, wrapped.global_clipnorm, wrapped.skip_nonfinite) == (4, 1.0, False)
    # Given options win; a clipping mode given replaces the model's own.
    rewrapped = SafeDistributedModel.from_model(safe, clipnorm=0.5, gradient_accumulation_steps=2)
    assert (rewrapped.gradient_accumulation_steps, rewrapped.clipnorm, rewrapped.global_clipnorm) == (2, 0.5, None)


@pytest.mark.parametrize("method", ["compute_loss", "train_step", "test_step"])
def test_from_model_refuses_a_class_that_overrides_the_step(method):
    def override(self, *args, **kwargs):
        return getattr(keras.Model, method)(self, *args, **kwargs)

    Penalized = type("Penalized", (keras.Model,), {method: override})
    inputs = keras.Input((3,))
    model = Penalized(inputs, keras.layers.Dense(1)(inputs), name="penalized")
    with pytest.raises(TypeError) as error:
        SafeDistributedModel.from_model(model)
    assert str(error.value) == (
        "SafeDistributedModel.from_model() copies the layers of model 'penalized', not its class, "
        f"and Penalized overrides `{method}`: the wrapped model would train without it. Mix "
        "SafeDistributedModel into that class instead, `class SafePenalized(SafeDistributedModel, "
        "Penalized)`, and build the model from it (docs/model.md)."
    )


_TWO_STRATEGIES = """
import sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from keras_safe_dist import SafeDistributedModel

x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
stock = sys.argv[1] == "stock"
for steps, units in ((1, 8), (4, 5)):  # each fit under a new strategy over the same devices
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1)(keras.layers.Dense(units)(inputs))
        if stock:
            model = keras.Model(inputs, outputs)
        else:
            model = SafeDistributedModel(inputs, outputs, gradient_accumulation_steps=steps)
        model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(x, y, batch_size=8, verbose=0)
    except Exception as error:
        print("collectives collided:", "Shape mismatch in the collective instance" in str(error))
        print(f"{type(error).__name__}: {str(error).splitlines()[0][:400]}")
        break
"""


@pytest.mark.parametrize("side", ["stock", "safe"])
def test_a_second_mirrored_strategy_over_the_same_devices_is_named_as_the_cause(side):
    done = subprocess.run([sys.executable, "-c", _TWO_STRATEGIES, side], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.strip().splitlines()[-1]
    if side == "stock":  # TensorFlow's own failure: stock Keras meets it the same way
        assert printed.startswith("InvalidArgumentError: Graph execution error:")
        assert "collectives collided: True" in done.stdout
    else:
        assert printed.startswith(
            "RuntimeError: TensorFlow aborted an all-reduce whose number another strategy's all-reduce "
            "of another shape had taken: two MirroredStrategy objects over the same devices"
        )
        assert "Create one MirroredStrategy per process and build every model in its scope" in printed


def test_from_model_warns_when_a_layer_is_also_inside_another_of_its_layers(tmp_path):
    shared = keras.layers.Dense(3, name="shared")
    inner_inputs = keras.Input((3,))
    inner = keras.Model(inner_inputs, shared(inner_inputs), name="inner")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, shared(inner(inputs)))
    with pytest.warns(UserWarning, match=r"layer 'shared' is called by the model and also inside its layer 'inner'"):
        wrapped = SafeDistributedModel.from_model(model)
    np.testing.assert_allclose(wrapped.predict(np.ones((2, 3)), verbose=0),
                               model.predict(np.ones((2, 3)), verbose=0))


def test_from_model_of_a_model_without_shared_layers_does_not_warn():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(4)(inputs)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SafeDistributedModel.from_model(model)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainable_changed_without_compile_keeps_the_compiled_set_as_stock_does(
    replicas, accumulation
):
    # Keras's rule: `trainable` as it was at compile() holds until compile()
    # is called again. On TensorFlow stock keeps training the compiled set
    # (JAX refuses the change instead, as Keras's JAX backend cannot train it).
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")

    def train(stock, batch_size):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((4,))
        first, second = keras.layers.Dense(8), keras.layers.Dense(3)
        outputs = second(first(inputs))
        if stock:
            model = keras.Model(inputs, outputs)
        else:
            model = SafeDistributedModel(
                inputs, outputs, gradient_accumulation_steps=accumulation
            )
        first.trainable = False
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        compiled = [w.numpy().copy() for w in second.weights]
        first.trainable, second.trainable = True, False
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        return model.get_weights(), compiled, [w.numpy() for w in second.weights]

    reference, _, _ = train(stock=True, batch_size=8)
    with strategy_for(replicas).scope():
        weights, before, after = train(stock=False, batch_size=8 // accumulation)

    for ours, stock in zip(weights, reference):
        np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-6)
    # The compiled set, not the new one, trained in the second fit(): the
    # first layer's bias is still its initial zeros, the second layer moved.
    assert not np.any(weights[1])
    assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(after, before))
