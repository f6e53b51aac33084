"""NaNOnsetDetector: injected faults, each with its exact report, the actions and the files."""

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.backend.tensorflow import _nonfinite
from keras_safe_dist.backend.tensorflow import nan_probe as _nan_probe
from keras_safe_dist.callbacks import NaNOnsetDetector
from keras_safe_dist.nan import flags as _nan_flags
from keras_safe_dist.update import statistics

from conftest import regression_data
from conftest import strategy_for

BATCH = 8
TOLERANCE = 1e-5


@keras.saving.register_keras_serializable(package="keras_safe_dist_tests")
class Fragile(keras.layers.Layer):
    """log(1 + x): finite for the data below, NaN where a feature is < -1."""

    def call(self, inputs):
        return tf.math.log(1.0 + inputs)


class Root(keras.layers.Layer):
    """sqrt(x * w): finite forward for x >= 0, NaN gradient for w where x == 0."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, inputs):
        return tf.sqrt(inputs * self.w)


class SquareRootLoss(keras.losses.Loss):
    """sqrt(|y_pred| - y_true): NaN where y_true > |y_pred|, inputs and outputs finite."""

    def call(self, y_true, y_pred):
        return tf.sqrt(tf.abs(y_pred) - y_true + 100.0)


def data(samples=64):
    x, y, _ = regression_data(samples)
    return np.abs(x), y


def build(
    replicas,
    model_class=SafeDistributedModel,
    first=None,
    optimizer=None,
    loss="mse",
    jit_compile="auto",
    compile_options=None,
    **options,
):
    with strategy_for(replicas).scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        hidden = first(inputs) if first is not None else inputs
        hidden = keras.layers.Dense(3, activation="tanh", name="hidden")(hidden)
        outputs = keras.layers.Dense(1, name="out")(hidden)
        model = model_class(inputs, outputs, **options)
        model.compile(
            optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.05),
            loss=loss,
            jit_compile=jit_compile,
            **(compile_options or {}),
        )
    return model


def fit(model, x, y, detector, epochs=1):
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[detector])


def reference_weights(x, y, batches, first=None, batch_size=BATCH, lr=0.05):
    """Stock keras.Model on one device after `batches` updates."""
    model = build(1, keras.Model, first=first, optimizer=lambda: keras.optimizers.SGD(lr))
    model.fit(x[: batches * batch_size], y[: batches * batch_size], batch_size=batch_size, shuffle=False, verbose=0)
    return model.get_weights()


def assert_weights_close(expected, actual):
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=TOLERANCE, atol=1e-6)


def test_two_detectors_in_one_fit_are_refused_and_one_callback_alone_is_taken(replicas):
    x, y = data(16)
    model = build(replicas)
    with pytest.raises(ValueError, match="received 2 NaN onset detectors.*Pass one NaNOnsetDetector per fit"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[NaNOnsetDetector(), NaNOnsetDetector()])
    with pytest.raises(TypeError, match=r"must be callback instances\. Received the class NaNOnsetDetector\. Pass an instance, e\.g\. callbacks=\[NaNOnsetDetector\(\)\]"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[NaNOnsetDetector])
    # As stock Keras takes it: one callback, not in a list.
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=NaNOnsetDetector())
    assert len(history.history["loss"]) == 2


def test_nan_in_one_input_sample_names_its_batch_replica_and_writes_files(replicas, tmp_path):
    x, y = data()
    x[37, 2] = np.nan  # batch 4, row 5: the second replica's share with 2 replicas
    model = build(replicas)
    detector = NaNOnsetDetector(log_dir=tmp_path, history=3)
    history = fit(model, x, y, detector, epochs=2).history
    report = detector.report
    replica = 1 if replicas == 2 else 0
    assert (report["epoch"], report["batch"], report["kind"]) == (0, 4, "inputs")
    assert (report["replica"], report["replicas"], report["layer"]) == (replica, [replica], None)
    assert report["variables"] == [] and report["localized"] is True
    assert [(h["epoch"], h["batch"]) for h in report["history"]] == [(0, 2), (0, 3), (0, 4)]
    assert np.isnan(report["history"][-1]["loss"]) and np.isfinite(report["history"][0]["grad_norm"])
    # "stop": training ended after batch 4, whose update was skipped.
    assert history["skipped_updates"] == [1.0] and "nonfinite_replicas" not in history
    assert_weights_close(reference_weights(x, y, 4), model.get_weights())
    saved = json.loads((tmp_path / "nan_onset.json").read_text())
    assert saved["kind"] == "inputs" and saved["batch"] == 4 and saved["finding"]["code"] == "NAN001"
    batch = np.load(tmp_path / "nan_onset_batch.npz")
    share = slice(36, 40) if replicas == 2 else slice(32, 40)
    np.testing.assert_array_equal(batch["x"], x[share])
    np.testing.assert_array_equal(batch["y"], y[share])
    np.testing.assert_array_equal(batch["replica"], [replica] * (40 - share.start))
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("nan_onset")[0]
    markdown = text.tensor_proto.string_val[0].decode()
    assert text.step == 4 and "| kind | inputs |" in markdown and "| batch | 4 |" in markdown
    assert "NaN onset at epoch 0, batch 4" in markdown


def test_a_nan_in_shuffled_arrays_is_named_by_its_row_in_the_arrays(replicas):
    x, y = data()
    x[37, 2] = np.nan
    y[21, 0] = np.inf
    model = build(replicas)
    detector = NaNOnsetDetector(history=3)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=True, verbose=0, callbacks=[detector])
    report = detector.report
    assert report["kind"] == "inputs"
    # The first of the two bad rows that the shuffled order reached.
    assert report["array_rows"] in ([37], [21], [21, 37])
    rows = ", ".join(str(r) for r in report["array_rows"])
    assert f"In the arrays passed to fit() (before shuffling): row{'s' if len(report['array_rows']) > 1 else ''} {rows}." in report["summary"]


def test_a_nan_from_a_dataset_says_how_to_find_the_sample(replicas):
    x, y = data()
    x[37, 2] = np.nan
    model = build(replicas)
    detector = NaNOnsetDetector(history=3)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(dataset, epochs=1, verbose=0, callbacks=[detector])
    assert "array_rows" not in detector.report
    assert any(note.startswith("fit() got a dataset or generator, so the sample's place") for note in detector.report["notes"])


def test_layer_that_makes_nan_on_one_batch_is_named(replicas, capsys):
    x, y = data()
    x[19, 1] = -3.0  # batch 2: log(1 - 3) is NaN
    model = build(replicas, first=Fragile(name="fragile"))
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    report = detector.report
    # Row 3 of 8: the first replica's share.
    assert (report["batch"], report["kind"], report["layer"], report["replicas"]) == (2, "activations", "fragile", [0])
    assert report["finding"]["subject"] == "fragile"
    printed = capsys.readouterr().out
    assert "First layer with a non-finite output from finite inputs: fragile." in printed


@pytest.mark.parametrize("action,kind,layer", [("stop", "loss", None), ("restore", "activations", "fragile")])
def test_applied_nonfinite_update_is_replayed_only_from_the_restored_weights(action, kind, layer):
    x, y = data()
    x[19, 1] = -3.0  # batch 2: log(1 - 3) is NaN, and skip_nonfinite=False applies it
    model = build(1, first=Fragile(name="fragile"), skip_nonfinite=False)
    detector = NaNOnsetDetector(action=action)
    fit(model, x, y, detector)
    report = detector.report
    assert (report["batch"], report["kind"], report["layer"]) == (2, kind, layer)
    skipped_replay = any("the batch was not replayed" in note for note in report["notes"])
    assert skipped_replay is (action == "stop")
    if action == "restore":
        assert_weights_close(reference_weights(x, y, 2, first=Fragile()), model.get_weights())


def test_step_compiled_with_xla_captures_the_batch_and_names_the_layer(tmp_path):
    # XLA cannot change a variable's shape: the batch is captured outside the compiled step.
    x, y = data()
    x[19, 1] = -3.0  # batch 2: log(1 - 3) is NaN
    x[45, 0] = np.nan  # batch 5, never reached
    model = build(1, first=Fragile(name="fragile"), jit_compile=True)
    detector = NaNOnsetDetector(log_dir=tmp_path, action="restore")
    fit(model, x, y, detector)
    report = detector.report
    assert (report["batch"], report["kind"], report["layer"], report["replica"]) == (2, "activations", "fragile", 0)
    assert model.jit_compile is True and model._xla_step is not None
    np.testing.assert_array_equal(np.load(tmp_path / "nan_onset_batch.npz")["x"], x[16:24])
    assert_weights_close(reference_weights(x, y, 2, first=Fragile()), model.get_weights())
    # The compiled step stays out of a SavedModel.
    tf.saved_model.save(model, str(tmp_path / "saved"))
    saved = tf.saved_model.load(str(tmp_path / "saved"))
    outputs = saved.signatures["serving_default"](tf.constant(x[:2]))
    np.testing.assert_allclose(
        next(iter(outputs.values())).numpy(), model.predict(x[:2], verbose=0), rtol=TOLERANCE
    )


@pytest.mark.parametrize("layout", ["sparse", "ragged"])
def test_sparse_and_ragged_inputs_are_checked_but_not_captured(replicas, layout, tmp_path):
    rng = np.random.default_rng(0)
    dense = (rng.normal(size=(64, 6)) * (rng.random((64, 6)) < 0.5)).astype("float32")
    dense[37, 2] = np.nan  # batch 4, row 5: the second replica's share with 2 replicas
    y = rng.normal(size=(64, 1)).astype("float32")
    with strategy_for(replicas).scope():
        keras.utils.set_random_seed(1)
        if layout == "sparse":
            x = tf.sparse.from_dense(dense)
            inputs = keras.Input((6,), sparse=True)
            hidden = keras.layers.Dense(3, name="hidden")(inputs)
        else:
            x = tf.ragged.stack([tf.constant(row[row != 0]) for row in dense])
            inputs = keras.Input((None,), ragged=True)
            hidden = keras.layers.Lambda(lambda t: tf.reduce_sum(t, axis=1, keepdims=True))(inputs)
        model = SafeDistributedModel(inputs, keras.layers.Dense(1, name="out")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    detector = NaNOnsetDetector(log_dir=tmp_path)
    model.fit(dataset, epochs=1, shuffle=False, verbose=0, callbacks=[detector])
    report = detector.report
    replica = 1 if replicas == 2 else 0
    assert (report["batch"], report["kind"], report["replicas"]) == (4, "inputs", [replica])
    assert "The batch could not be captured (sparse, ragged or non-numeric inputs)." in report["notes"]
    assert sorted(p.name for p in tmp_path.glob("nan_onset*")) == ["nan_onset.json"]


def test_subclassed_model_names_the_nested_layer():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.fragile = Fragile(name="inner_fragile")
            self.dense = keras.layers.Dense(3)

        def call(self, inputs):
            return self.dense(self.fragile(inputs))

    class Net(SafeDistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Block(name="block")
            self.out = keras.layers.Dense(1)

        def call(self, inputs):
            return self.out(self.block(inputs))

    x, y = data()
    x[50, 0] = -2.0  # batch 6
    model = Net()
    model.compile(optimizer="sgd", loss="mse")
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    assert (detector.report["batch"], detector.report["kind"], detector.report["layer"]) == (6, "activations", "inner_fragile")


def test_loss_function_that_makes_nan_reports_loss_without_a_layer():
    x, y = data()
    y[13] = 1000.0  # batch 1: sqrt of a negative number in the loss
    model = build(1, loss=SquareRootLoss())
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    assert (detector.report["batch"], detector.report["kind"], detector.report["layer"]) == (1, "loss", None)


@pytest.mark.parametrize("steps", [1, 2])
def test_nan_gradient_from_finite_loss_names_the_variable_and_replica(replicas, steps):
    x, y = data()
    x[29] = 0.0  # batch 3, row 5: d sqrt(x * w) / dw = 0 / 0 on the second replica's share
    model = build(replicas, first=Root(name="root"), gradient_accumulation_steps=steps)
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    report = detector.report
    assert (report["batch"], report["kind"], report["layer"]) == (3, "gradients", None)
    assert report["variables"] == ["root/w"]
    assert report["replicas"] == [replicas - 1]


class Exploding(keras.optimizers.schedules.LearningRateSchedule):
    """0.05, then 1e38 from update `at` on."""

    def __init__(self, at=3):
        self.at = at

    def __call__(self, step):
        return tf.where(step < self.at, 0.05, 1e38)


def test_exploding_learning_rate_restores_last_finite_weights_and_optimizer_state(replicas):
    x, y = data()
    y = y * 10.0  # gradients large enough for 1e38 * g to overflow
    model = build(replicas, optimizer=lambda: keras.optimizers.SGD(Exploding()))
    detector = NaNOnsetDetector(action="restore")
    history = fit(model, x, y, detector, epochs=2).history
    report = detector.report
    # Batch 3's update overflowed; batch 4 found the weights non-finite when it began.
    assert (report["epoch"], report["batch"], report["step"], report["kind"]) == (0, 3, 3, "weights")
    assert (report["replica"], report["replicas"], report["layer"], report["files"]) == (None, [], None, {})
    assert report["variables"] and set(report["variables"]) <= {"hidden/kernel", "hidden/bias", "out/kernel", "out/bias"}
    assert [h["batch"] for h in report["history"]] == [0, 1, 2, 3]
    assert report["restored_to"] == "before this batch"
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert_weights_close(reference_weights(x, y, 3), model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 3
    assert len(history["loss"]) == 1


def test_step_compiled_with_xla_finds_weights_the_update_broke():
    # Under XLA the weights are checked before the compiled step, and their flag added after it.
    x, y = data()
    model = build(1, optimizer=lambda: keras.optimizers.SGD(Exploding()), jit_compile=True)
    detector = NaNOnsetDetector(action="restore")
    fit(model, x, y * 100.0, detector)
    report = detector.report
    assert model._xla_step is not None
    assert (report["batch"], report["step"], report["kind"], report["restored_to"]) == (
        3, 3, "weights", "before this batch"
    )
    # XLA's tanh is an approximation: 1e-4 apart from the plain step after three updates.
    for expected, actual in zip(reference_weights(x, y * 100.0, 3), model.get_weights()):
        np.testing.assert_allclose(actual, expected, rtol=1e-3)


def test_overflowing_last_update_of_an_epoch_is_found_at_the_epoch_end(monkeypatch):
    checks = []
    check = _nan_probe.WeightCheck.__call__
    monkeypatch.setattr(_nan_probe.WeightCheck, "__call__", lambda self: checks.append(1) or check(self))
    x, y = data()
    y = y * 10.0
    model = build(2, optimizer=lambda: keras.optimizers.SGD(Exploding(at=7)))
    detector = NaNOnsetDetector(action="restore")
    history = fit(model, x, y, detector, epochs=2).history
    report = detector.report
    assert (report["epoch"], report["batch"], report["step"], report["kind"]) == (0, 7, 7, "weights")
    assert len(checks) == 1  # one host sync: the report reuses the epoch-end check
    assert report["restored_to"] == "before this batch" and len(history["loss"]) == 1
    assert_weights_close(reference_weights(x, y, 7), model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 7


@pytest.mark.parametrize("model_class", [SafeDistributedModel, keras.Model], ids=["safe", "plain"])
def test_epoch_end_weight_check_is_traced_once_per_model_across_fits(model_class):
    x, y = data()
    model = build(1, model_class=model_class)
    fit(model, x, y, NaNOnsetDetector())
    check = _nan_probe.WeightCheck.of(model)
    fit(model, x, y, NaNOnsetDetector(), epochs=2)  # a new detector, a new fit()
    assert _nan_probe.WeightCheck.of(model) is check
    assert check.function.experimental_get_tracing_count() == 1
    model.get_layer("out").trainable = False
    frozen = _nan_probe.WeightCheck.of(model)
    assert [v.path for v in frozen.variables] == ["hidden/kernel", "hidden/bias"]


def test_mixed_precision_ignores_loss_scale_overflows_and_finds_nan_inputs():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = data()
    x[5 * BATCH + 1, 0] = np.nan  # batch 5, the first replica's share
    model = build(
        2,
        optimizer=lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05), initial_scale=2.0**40, dynamic_growth_steps=2
        ),
    )
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    report = detector.report
    # The scaled gradients overflowed float16 on the first batches; those
    # updates were skipped and the scale halved, without a report.
    assert float(model.optimizer.dynamic_scale.numpy()) < 2.0**40
    assert any(not np.isfinite(h["grad_norm"]) for h in report["history"])
    assert (report["batch"], report["kind"], report["replicas"]) == (5, "inputs", [0])
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_weights_nonfinite_before_training_are_reported_without_a_restore():
    x, y = data()
    model = build(2)
    kernel = model.get_layer("out").kernel
    kernel.assign(np.full(kernel.shape, np.inf, np.float32))
    detector = NaNOnsetDetector(action="restore")
    fit(model, x, y, detector)
    report = detector.report
    assert (report["epoch"], report["batch"], report["step"], report["kind"]) == (0, 0, 0, "weights")
    assert report["variables"] == ["out/kernel"] and report["restored_to"] is None
    assert report["notes"][-2:] == [
        "The weights were non-finite before training began.",
        "No finite copy of the weights was available to restore.",
    ]


def test_probe_refuses_more_replicas_than_its_flags_can_count(monkeypatch):
    model = build(2)
    monkeypatch.setattr(_nan_probe, "MAX_REPLICAS", 1)
    request = _nan_flags.ProbeRequest(snapshot=False, count_updates=False)
    with pytest.raises(ValueError, match=r"support up to 1 replicas in sync. Received: a strategy with 2 replicas"):
        _nan_probe.NaNProbe(model, request, None)


def test_overflowing_epoch_end_flush_is_reported_and_restored(replicas):
    x, y = data(56)  # 7 micro-batches of 8: three groups of 2, then one flushed at the epoch end
    y = y * 10.0
    model = build(replicas, optimizer=lambda: keras.optimizers.SGD(Exploding()), gradient_accumulation_steps=2)
    detector = NaNOnsetDetector(action="restore")
    fit(model, x, y, detector, epochs=2)
    report = detector.report
    # The fourth update (learning rate 1e38) is the flush after micro-batch 6.
    assert (report["epoch"], report["batch"], report["kind"], report["replicas"]) == (0, 6, "weights", [])
    assert report["variables"] and report["files"] == {}
    assert report["restored_to"] == "before this batch"
    assert_weights_close(reference_weights(x, y, 3, batch_size=2 * BATCH), model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("execution", [1, 3], ids=["one_step", "three_steps_per_execution"])
def test_accumulation_reports_the_micro_batch_and_skips_its_group(replicas, execution):
    x, y = data()
    x[33, 0] = np.inf  # micro-batch 4 (first of the third group), the first replica's share
    model = build(
        replicas, gradient_accumulation_steps=2, compile_options={"steps_per_execution": execution}
    )
    detector = NaNOnsetDetector()
    history = fit(model, x, y, detector).history
    report = detector.report
    assert (report["batch"], report["kind"], report["replicas"]) == (4, "inputs", [0])
    # The pending group (micro-batch 4 only) was flushed at the epoch end and skipped.
    assert history["skipped_updates"] == [1.0]
    assert_weights_close(reference_weights(x, y, 2, batch_size=2 * BATCH), model.get_weights())


def test_healthy_training_is_identical_with_and_without_detector(replicas):
    x, y = data()
    plain = build(replicas)
    expected = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    model = build(replicas)
    detector = NaNOnsetDetector(action="restore")
    history = fit(model, x, y, detector, epochs=2).history
    assert detector.report is None
    # The detector turns on the update statistics it reads; the rest is as without it.
    assert set(history) - set(expected) == set(statistics.LOG_NAMES)
    assert {name: history[name] for name in expected} == expected
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # A later fit without the detector drops the checks from the step.
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert model._nan_link.probe is None


def large(x):
    """Values in [2.5e37, 3e37]: finite, but 16 of them overflow a float32 sum."""
    x = np.abs(x)
    return (2.5e37 + 0.5e37 * x / x.max()).astype("float32")


class Huge(keras.layers.Layer):
    """x * mean(w / 3e37) = x, with `w` sixteen values of 3e37: finite, but its sum overflows."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(16,), initializer=keras.initializers.Constant(3e37), name="w")

    def call(self, inputs):
        return inputs * tf.reduce_mean(self.w / 3e37)


def fit_stock(x, y, epochs, first=None):
    """Stock keras.Model on one device: its history and weights."""
    model = build(1, keras.Model, first=first)
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0).history
    return history, model.get_weights()


def test_large_finite_inputs_whose_sum_overflows_train_as_stock_keras(replicas):
    x, y = data()
    x = large(x)
    # Each replica's share of a batch sums to infinity in float32.
    assert np.isinf(tf.reduce_sum(x[: BATCH // replicas]).numpy())
    model = build(replicas)
    detector = NaNOnsetDetector()
    history = fit(model, x, y, detector, epochs=2).history
    assert detector.report is None
    assert history["skipped_updates"] == [0.0, 0.0]
    expected, weights = fit_stock(x, y, epochs=2)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=TOLERANCE)
    assert_weights_close(weights, model.get_weights())


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_nonfinite_input_among_large_finite_inputs_is_reported_at_its_batch(replicas, value):
    x, y = data()
    x = large(x)
    x[37, 2] = value  # batch 4, row 5: the second replica's share with 2 replicas
    model = build(replicas)
    detector = NaNOnsetDetector()
    history = fit(model, x, y, detector, epochs=2).history
    report = detector.report
    replica = 1 if replicas == 2 else 0
    # With 2 replicas the first share (large, finite, its sum infinite) is not named.
    assert (report["epoch"], report["batch"], report["kind"]) == (0, 4, "inputs")
    assert (report["replica"], report["replicas"]) == (replica, [replica])
    assert [h["batch"] for h in report["history"]] == [0, 1, 2, 3, 4]
    assert history["skipped_updates"] == [1.0] and len(history["loss"]) == 1


def test_huge_finite_weight_is_not_reported_and_an_infinity_among_huge_values_is(replicas):
    x, y = data()
    model = build(replicas, first=Huge(name="huge"))
    detector = NaNOnsetDetector()
    history = fit(model, x, y, detector, epochs=2).history
    # Checked before every step and at each epoch end; its sum and squared norm overflow.
    assert detector.report is None
    assert history["skipped_updates"] == [0.0, 0.0]
    expected, weights = fit_stock(x, y, epochs=2, first=Huge(name="huge"))
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=TOLERANCE)
    assert_weights_close(weights, model.get_weights())
    model.get_layer("huge").w.assign(np.array([3e37] * 15 + [np.inf], np.float32))
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    report = detector.report
    assert (report["epoch"], report["batch"], report["step"], report["kind"]) == (0, 0, 0, "weights")
    assert report["variables"] == ["huge/w"]


def test_step_compiled_with_xla_passes_huge_finite_inputs_and_weights_and_finds_a_nan():
    x, y = data()
    x = large(x)
    x[45, 0] = np.nan  # batch 5
    model = build(1, first=Huge(name="huge"), jit_compile=True)
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    report = detector.report
    assert model._xla_step is not None
    assert (report["batch"], report["kind"], report["replicas"]) == (5, "inputs", [0])
    assert [h["batch"] for h in report["history"]] == [0, 1, 2, 3, 4, 5]
    assert all(np.isfinite(h["loss"]) for h in report["history"][:-1])


def test_continue_skips_nonfinite_updates_then_stops_after_too_many_in_a_row(capsys):
    x, y = data()
    for batch in (1, 4, 5, 6):
        x[batch * BATCH, 3] = np.nan
    model = build(1)
    detector = NaNOnsetDetector(action="continue", max_consecutive_skips=3)
    history = fit(model, x, y, detector, epochs=2).history
    report = detector.report
    assert (report["batch"], report["kind"]) == (1, "inputs")
    assert report["skips"]["code"] == "NAN002"
    assert report["skips"]["message"] == (
        "3 consecutive updates were skipped as non-finite, the last at epoch 0, batch 6"
    )
    assert history["skipped_updates"] == [4.0] and len(history["loss"]) == 1
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert "3 consecutive updates were skipped" in capsys.readouterr().out


def test_plain_keras_model_reports_loss_and_says_what_is_not_localized(replicas, capsys):
    x, y = data()
    x[37, 2] = np.nan
    model = build(replicas, keras.Model)
    detector = NaNOnsetDetector()
    fit(model, x, y, detector)
    report = detector.report
    assert (report["batch"], report["kind"], report["layer"], report["replica"]) == (4, "loss", None, None)
    assert report["localized"] is False and report["files"] == {}
    assert "the layer, the replica and the batch itself are not localized" in capsys.readouterr().out


def test_plain_keras_model_restore_finds_the_update_that_broke_the_weights(replicas):
    x, y = data()
    y = y * 10.0
    model = build(replicas, keras.Model, optimizer=lambda: keras.optimizers.SGD(Exploding()))
    detector = NaNOnsetDetector(action="restore")
    fit(model, x, y, detector)
    report = detector.report
    # The loss turns non-finite at batch 4; the weights were already broken by batch 3's update.
    assert (report["batch"], report["kind"], report["restored_to"]) == (3, "weights", "before the previous batch")
    assert_weights_close(reference_weights(x, y, 3), model.get_weights())


def test_probe_flags_decode_both_bitmasks_and_fall_back_to_counts():
    # Replicas 0 and 3 of 4 fired; replica 3's inputs were non-finite. B = 2**4.
    step = _nan_flags.decode({"nonfinite_replicas": float(0b1001 + 16 * 0b1000)}, 4)
    assert (step.fired, step.replicas, step.inputs, step.input_replicas, step.weights) == (2, (0, 3), 1, (3,), 0)
    # All 16 replicas fired, with non-finite inputs, and began with non-finite weights.
    step = _nan_flags.decode({"nonfinite_replicas": float((2**16 - 1) * (1 + 2**16) + 16 * 2**32)}, 16)
    assert (step.replicas, step.input_replicas, step.weights) == (tuple(range(16)), tuple(range(16)), 16)
    # Beyond 16 replicas the fields are counts, in base replicas + 1.
    step = _nan_flags.decode({"nonfinite_replicas": float(5 + 33 * 2 + 33**2 * 32)}, 32)
    assert (step.fired, step.replicas, step.inputs, step.input_replicas, step.weights) == (5, (), 2, (), 32)


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4, 5, 16, 17, 8191])
def test_probe_flags_survive_the_mean_reduction_exactly(num_replicas):
    # Each replica scales its entry by the number of replicas; Keras sums and
    # divides, in the entry's dtype. Every replica fired with non-finite
    # inputs (the largest fields), and began with non-finite weights.
    base = _nan_flags.base(num_replicas)
    masks = num_replicas <= _nan_flags.MAX_REPLICAS_FOR_MASK
    ids = range(min(num_replicas, 16))
    per_replica = np.full(num_replicas, float(base**2))
    per_replica[: len(ids)] += [(2.0**r if masks else 1.0) * (1 + base) for r in ids]
    dtype = _nan_probe.entry_dtype(num_replicas)
    scaled = tf.constant(per_replica * num_replicas, dtype)
    for mean in (tf.reduce_sum(scaled) / num_replicas, tf.reduce_sum(scaled) * (1 / num_replicas)):
        step = _nan_flags.decode({"nonfinite_replicas": float(mean)}, num_replicas)
        assert step.fired == step.inputs == len(ids) and step.weights == num_replicas
    assert dtype == (tf.float32 if num_replicas <= 4 else tf.float64)


def test_probe_entry_is_exact_sum_of_flagged_groups():
    # One group per field; a group is flagged by a NaN, an infinity or an overflowing total.
    groups = [[tf.constant(1.0), tf.constant(np.nan)], [tf.constant(3e38), tf.constant(3e38)], [tf.constant(2.0)]]
    for dtype in (tf.float32, tf.float64):
        assert float(_nonfinite.nonfinite_sum(groups, [1.0, 16.0, 256.0], dtype)) == 17.0
        assert float(_nonfinite.nonfinite_sum([[], [tf.constant(1.0)] * 3], [1.0, 2.0], dtype)) == 0.0


def test_input_and_weight_checks_count_only_nan_and_inf_and_gradient_checks_count_overflow():
    # Inputs: a sum that overflows float32 is confirmed element by element.
    assert not bool(_nan_probe.inputs_nonfinite([np.array([3e38, -3e38], np.float32)]))
    assert not bool(_nan_probe.inputs_nonfinite([np.array([3e38, 3e38], np.float32)]))
    assert not bool(_nan_probe.inputs_nonfinite([np.full((2, 3), 3e37, np.float32)] * 3))
    assert bool(_nan_probe.inputs_nonfinite([np.array([3e38, 3e38, np.inf], np.float32)]))
    assert bool(_nan_probe.inputs_nonfinite([np.full((4,), 3e38, np.float32), np.array([np.nan])]))
    assert bool(_nan_probe.inputs_nonfinite([np.array([1.0, np.nan], np.float32)]))
    assert bool(_nan_probe.inputs_nonfinite([np.array([-np.inf, np.inf], np.float32)]))
    assert not bool(_nan_probe.inputs_nonfinite([np.array([2**31 - 1, 1], np.int32)]))
    assert not bool(_nan_probe.inputs_nonfinite([np.full((1000,), 6e4, np.float16)]))  # sums in float32
    assert bool(_nan_probe.inputs_nonfinite([np.array([6e4, np.inf], np.float16)]))
    assert not bool(_nan_probe.inputs_nonfinite([np.array([3e38, 3e38], np.float64)]))
    # Weights: likewise, per variable.
    values = {"a": [1e20] * 4, "b": [3e37] * 16, "c": [3e37] * 15 + [np.inf], "d": [np.nan, 1.0]}
    variables = [keras.Variable(np.array(v, np.float32), name=n) for n, v in values.items()]
    assert _nan_probe.WeightCheck([keras.Variable([1.0, 2.0]), *variables[:2]])() == []
    assert _nan_probe.WeightCheck(variables)() == ["c", "d"]
    # Gradients: the squared norm, as for the update's gradient norm (the update is skipped).
    assert not bool(_nan_probe.tensor_nonfinite(np.full((4,), 1e18, np.float32)))
    assert bool(_nan_probe.tensor_nonfinite(np.full((4,), 1e20, np.float32)))
    assert bool(_nan_probe.tensor_nonfinite(np.array([0.0, -np.inf], np.float16)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"action": "halt"}, "`action` must be one of 'stop', 'restore', 'continue'. Received: action='halt'"),
        ({"history": 0}, "`history` must be an integer >= 1. Received: history=0"),
        ({"history": 2.5}, "Received: history=2.5"),
        ({"max_consecutive_skips": True}, "`max_consecutive_skips` must be an integer >= 1. Received: max_consecutive_skips=True"),
        ({"check_every": 0}, "`check_every` must be an integer >= 1. Received: check_every=0"),
        ({"check_every": "8"}, "`check_every` must be an integer >= 1. Received: check_every='8'"),
    ],
)
def test_bad_arguments_raise_naming_argument_and_value(kwargs, message):
    with pytest.raises(ValueError) as error:
        NaNOnsetDetector(**kwargs)
    assert message in str(error.value)


def test_bad_log_dir_raises_a_type_error():
    with pytest.raises(TypeError, match=r"`log_dir` must be a path \(str or os.PathLike\) or None. Received: log_dir=3"):
        NaNOnsetDetector(log_dir=3)


def test_continue_needs_a_model_that_skips_nonfinite_updates():
    x, y = data(16)
    for model, received in (
        (build(1, keras.Model), "Received: Functional."),
        (build(1, skip_nonfinite=False), "Received: SafeDistributedFunctional with skip_nonfinite=False."),
    ):
        with pytest.raises(ValueError, match="needs a SafeDistributedModel with skip_nonfinite=True") as error:
            fit(model, x, y, NaNOnsetDetector(action="continue"))
        assert received in str(error.value)


@pytest.mark.parametrize("row,batch", [(37, 4), (25, 3)], ids=["mid_execution", "first_of_execution"])
def test_several_steps_per_execution_name_the_exact_batch_and_stop_there(replicas, row, batch, tmp_path):
    x, y = data()
    x[row, 2] = np.nan  # executions of 3 batches: 0-2, 3-5
    model = build(replicas, compile_options={"steps_per_execution": 3})
    detector = NaNOnsetDetector(log_dir=tmp_path)
    history = fit(model, x, y, detector, epochs=2).history
    report = detector.report
    replica = 1 if replicas == 2 and row % BATCH >= BATCH // 2 else 0
    assert (report["epoch"], report["batch"], report["step"], report["kind"]) == (0, batch, batch, "inputs")
    assert report["replicas"] == [replica]
    # The history holds each execution's last step.
    assert [h["batch"] for h in report["history"]] == [2, batch]
    # The execution ended at the onset: batches after it were not trained.
    assert history["skipped_updates"] == [1.0] and "executed_steps" not in history
    assert_weights_close(reference_weights(x, y, batch), model.get_weights())
    saved = np.load(tmp_path / "nan_onset_batch.npz")
    start = batch * BATCH + (BATCH // 2 if replica else 0)
    np.testing.assert_array_equal(saved["x"][0], x[start])


def test_several_steps_per_execution_restore_the_weights_before_the_update_that_broke_them(replicas):
    x, y = data()
    y = y * 10.0
    model = build(
        replicas,
        optimizer=lambda: keras.optimizers.SGD(Exploding()),
        compile_options={"steps_per_execution": 3},
    )
    detector = NaNOnsetDetector(action="restore")
    fit(model, x, y, detector, epochs=2)
    report = detector.report
    # Batch 3's update overflowed; batch 4, in the same execution, found it.
    assert (report["epoch"], report["batch"], report["step"], report["kind"]) == (0, 3, 3, "weights")
    assert report["restored_to"] == "before this batch"
    assert_weights_close(reference_weights(x, y, 3), model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize(
    "model_class,options,detector,received",
    [
        (keras.Model, {}, {}, "with a Functional, whose executions report only their last step"),
        (SafeDistributedModel, {"run_eagerly": True}, {}, "with run_eagerly=True. Use run_eagerly=False"),
        (
            SafeDistributedModel,
            {},
            {"action": "continue"},
            "with action='continue', which counts skipped updates step by step. Use action='stop'",
        ),
    ],
    ids=["plain", "eager", "continue"],
)
def test_several_steps_per_execution_are_refused_where_the_batch_cannot_be_named(
    model_class, options, detector, received
):
    x, y = data(16)
    model = build(1, model_class, compile_options={"steps_per_execution": 2, **options})
    with pytest.raises(ValueError, match="with steps_per_execution=2 it needs each step's logs") as error:
        fit(model, x, y, NaNOnsetDetector(**detector))
    assert received in str(error.value)


def test_settings_that_would_have_no_effect_are_named(replicas):
    with pytest.warns(UserWarning, match=r"max_consecutive_skips=3 has no effect with action='stop'; it bounds"):
        NaNOnsetDetector(action="stop", max_consecutive_skips=3)
    x, y = data(16)
    model = build(replicas)
    # On TensorFlow every step's logs are checked: no record to space the reads of.
    with pytest.warns(UserWarning, match=r"check_every=5 has no effect here.*With SafeDistributedFunctional on tensorflow every step's logs are checked"):
        fit(model, x, y, NaNOnsetDetector(check_every=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NaNOnsetDetector(action="continue", max_consecutive_skips=3)
        fit(model, x, y, NaNOnsetDetector())


def test_config_round_trip(tmp_path):
    detector = NaNOnsetDetector(
        log_dir=tmp_path, action="continue", history=7, max_consecutive_skips=2, check_every=5
    )
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(detector))
    assert isinstance(restored, NaNOnsetDetector)
    assert restored.get_config() == {
        "log_dir": str(tmp_path), "action": "continue", "history": 7, "max_consecutive_skips": 2,
        "check_every": 5,
    }
