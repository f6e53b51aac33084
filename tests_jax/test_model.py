"""SafeDistributedModel on JAX against stock Keras on one device with one batch of the same samples."""

import os
import subprocess
import sys
import warnings

import jax
import keras
import numpy as np
import pytest

import keras_safe_dist
from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.backend.jax import _gradients as _jax_gradients

from conftest import needs_tensorflow
from conftest import one_device
from conftest import regression_data


def _mlp(model_class, batch_norm=False, seed=1, **options):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    if model_class is keras.Model:
        return keras.Model(inputs, outputs)
    return SafeDistributedModel(inputs, outputs, **options)


def _relative_error(model, reference):
    return max(
        float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        for a, b in zip(model.get_weights(), reference.get_weights())
    )


def _stock_fit(x, y, batch_size, epochs=1, optimizer=None, loss="mse", **fit_kwargs):
    def build():
        reference = _mlp(keras.Model, batch_norm=fit_kwargs.pop("batch_norm", False))
        reference.compile(optimizer or keras.optimizers.SGD(0.1), loss)
        reference.fit(
            x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
        )
        return reference

    return one_device(build)


@pytest.mark.parametrize("batch_size", [33, 11, 16], ids=["batch33", "batch11", "last1"])
@pytest.mark.parametrize("batch_norm", [False, True], ids=["dense", "batchnorm"])
def test_any_batch_size_matchesone_device(devices, batch_size, batch_norm):
    x, y, _ = regression_data(33)
    reference = _stock_fit(x, y, batch_size, epochs=2, batch_norm=batch_norm)
    model = _mlp(SafeDistributedModel, batch_norm=batch_norm)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)

    assert _relative_error(model, reference) < 1e-5
    stock_loss = one_device(lambda: reference.evaluate(x, y, batch_size=batch_size, verbose=0))
    assert model.evaluate(x, y, batch_size=batch_size, verbose=0) == pytest.approx(
        stock_loss, rel=1e-5
    )
    stock_predictions = one_device(lambda: reference.predict(x, batch_size=batch_size, verbose=0))
    np.testing.assert_allclose(
        model.predict(x, batch_size=batch_size, verbose=0), stock_predictions, rtol=1e-5, atol=1e-6
    )
    assert np.isfinite(history.history["loss"]).all()


def test_stock_keras_still_fails_on_an_indivisible_batch(devices):
    if devices == 1:
        pytest.skip("one device divides every batch")
    x, y, _ = regression_data(33)
    stock = _mlp(keras.Model)
    stock.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(Exception, match="IndivisibleError|partitioned|divisible"):
        stock.fit(x, y, batch_size=33, verbose=0)
    # The placement SafeDistributedModel uses is Keras's again outside its calls.
    with pytest.raises(Exception, match="IndivisibleError|partitioned|divisible"):
        stock.evaluate(x, y, batch_size=33, verbose=0)


def test_on_batch_methods_take_an_indivisible_batch(devices):
    x, y, w = regression_data(7)
    reference = one_device(lambda: _mlp(keras.Model))
    one_device(lambda: reference.compile(keras.optimizers.SGD(0.1), "mse"))
    stock_logs = one_device(lambda: reference.train_on_batch(x, y, sample_weight=w))
    model = _mlp(SafeDistributedModel)
    model.compile(keras.optimizers.SGD(0.1), "mse")

    logs = model.train_on_batch(x, y, sample_weight=w)

    assert logs == pytest.approx(stock_logs, rel=1e-5)
    assert _relative_error(model, reference) < 1e-5
    assert model.test_on_batch(x, y) == pytest.approx(
        one_device(lambda: reference.test_on_batch(x, y)), rel=1e-5
    )
    np.testing.assert_allclose(
        model.predict_on_batch(x), one_device(lambda: reference.predict_on_batch(x)), rtol=1e-5
    )


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.MeanSquaredError(),
        keras.losses.MeanSquaredError(reduction="sum"),
        keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
    ],
    ids=["sum_over_batch_size", "sum", "mean_with_sample_weight"],
)
def test_accumulation_of_uneven_micro_batches_is_one_big_batch(devices, loss):
    # 34 samples in micro-batches of 16, 16 and 2: one update.
    x, y, w = regression_data(34)
    reference = _stock_fit(x, y, 34, loss=loss, sample_weight=w)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=3)
    model.compile(keras.optimizers.SGD(0.1), loss)

    model.fit(x, y, sample_weight=w, batch_size=16, shuffle=False, verbose=0)

    assert _relative_error(model, reference) < 1e-5


def test_stock_optimizer_accumulation_weights_micro_batches_equally(devices):
    # The defect the accumulation above fixes, measured on this backend.
    x, y, _ = regression_data(34)
    reference = _stock_fit(x, y, 34)
    stock = _mlp(keras.Model)
    stock.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=3), "mse")
    stock.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert _relative_error(stock, reference) > 1e-2


def test_sample_weights_keras_would_spread_across_the_batch_are_refused(devices):
    x, y, _ = regression_data(8)
    weights = np.arange(1, 9, dtype="float32").reshape(8, 1, 1)
    model = _mlp(SafeDistributedModel)
    model.compile(optimizer="sgd", loss="mse")
    initial = model.get_weights()
    with pytest.raises(ValueError, match=r"sample_weight of shape \(8, 1, 1\) for loss values of shape \(8,\)"):
        model.fit(x, y, sample_weight=weights, batch_size=8, verbose=0)
    # Refused while the first step was traced: Keras had taken the values off
    # the model for it; they are back, unchanged.
    for kept, value in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(kept, value)
    # train_on_batch() leaves its state on the model; a refused fit() after
    # set_weights() keeps the weights set, not that call's.
    with pytest.raises(ValueError, match="broadcast across the batch"):
        model.train_on_batch(x, y, sample_weight=weights)
    model.train_on_batch(x, y)
    model.set_weights(initial)
    with pytest.raises(ValueError, match="broadcast across the batch"):
        model.fit(x, y, sample_weight=weights, batch_size=8, verbose=0)
    for kept, value in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(kept, value)
    stock = _mlp(keras.Model)
    stock.compile(optimizer="sgd", loss="mse")
    stock.fit(x, y, sample_weight=weights.reshape(8, 1), batch_size=8, epochs=2, verbose=0)
    model.fit(x, y, sample_weight=weights.reshape(8, 1), batch_size=8, epochs=2, verbose=0)
    assert _relative_error(model, stock) <= 1e-5


def test_class_weights_and_a_partial_group_at_epoch_end(devices):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 4)).astype("float32")
    labels = (x[:, 0] > 0.3).astype("int32")
    class_weight = {0: 0.5, 1: 2.0}

    def build(model_class, **options):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(2, activation="softmax")(inputs)
        if model_class is keras.Model:
            return keras.Model(inputs, outputs)
        return SafeDistributedModel(inputs, outputs, **options)

    def stock():
        reference = build(keras.Model)
        reference.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy")
        # Two updates per epoch: 32 samples, then the last 8.
        reference.fit(x, labels, batch_size=32, epochs=2, class_weight=class_weight,
                      shuffle=False, verbose=0)
        return reference

    reference = one_device(stock)
    model = build(SafeDistributedModel, gradient_accumulation_steps=2, log_update_stats=True)
    model.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy")

    history = model.fit(x, labels, batch_size=16, epochs=2, class_weight=class_weight,
                        shuffle=False, verbose=0)

    assert _relative_error(model, reference) < 1e-5
    assert history.history["samples_per_update"] == [8.0, 8.0]
    assert history.history["samples_per_update_max"] == [32.0, 32.0]
    assert int(model.optimizer.iterations.numpy()) == 4


@pytest.mark.parametrize("clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.05}, {"clipvalue": 0.01}])
def test_clipping_applies_after_accumulation(devices, clip):
    x, y, _ = regression_data(34)
    reference = _stock_fit(x, y, 34, optimizer=keras.optimizers.SGD(0.1, **clip))
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=3, log_update_stats=True, **clip)
    model.compile(keras.optimizers.SGD(0.1), "mse")

    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)

    assert _relative_error(model, reference) < 1e-5
    assert history.history["clip_rate"] == [1.0]


def test_a_nonfinite_update_is_skipped_counted_and_warned_once(devices):
    x, y, _ = regression_data(32)
    x[20, 1] = np.nan
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2, log_update_stats=True)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)  # one clean update: Adam has state
    weights = [w.copy() for w in model.get_weights()]
    optimizer_state = [v.numpy().copy() for v in model.optimizer.variables]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x[16:], y[16:], batch_size=8, shuffle=False, verbose=0)

    for after, before in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(after, before)
    for variable, before in zip(model.optimizer.variables, optimizer_state):
        np.testing.assert_array_equal(variable.numpy(), before)
    assert history.history["skipped_updates"] == [1.0]
    skipped = [w for w in caught if "skipped a non-finite update" in str(w.message)]
    assert len(skipped) == 1
    assert "update 0 (micro-batches 0 to 1)" in str(skipped[0].message)


def test_without_skipping_a_nonfinite_update_is_applied(devices):
    x, y, _ = regression_data(8)
    x[3, 0] = np.nan
    model = _mlp(SafeDistributedModel, skip_nonfinite=False)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    assert np.isnan(model.get_weights()[0]).any()


def _wide_mlp(model_class, **options):
    # One large kernel (64 x 80) beside small kernels and biases.
    keras.utils.set_random_seed(3)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(80, activation="relu")(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(hidden))
    if model_class is keras.Model:
        return keras.Model(inputs, outputs)
    return SafeDistributedModel(inputs, outputs, **options)


def _stock_gradient(x, y):
    """The one-device gradient of stock Keras's MSE on `x`, read from an SGD(1) step."""

    def build():
        reference = _wide_mlp(keras.Model)
        reference.compile(keras.optimizers.SGD(1.0), "mse")
        before = [w.copy() for w in reference.get_weights()]
        reference.train_on_batch(x, y)
        return [b - a for b, a in zip(before, reference.get_weights())]

    return one_device(build)


def _norm(arrays):
    """The global norm of `arrays`, in float64."""
    return float(np.sqrt(sum(np.sum(np.square(a.astype("float64"))) for a in arrays)))


@pytest.fixture(params=["per_tensor", "joined"])
def norm_sum(request, monkeypatch):
    """The global norm summed per tensor (a CPU's default) or over the joined
    gradients (a GPU's), forced for the models built in the test."""
    monkeypatch.setattr(_jax_gradients, "NORM_BY_CONCATENATION", request.param == "joined")
    return request.param


def test_logged_grad_norm_is_the_one_device_gradient_norm(devices, norm_sum):
    x, y, _ = regression_data(10, features=64)
    gradient = _stock_gradient(x, y)
    expected = _norm(gradient)
    model = _wide_mlp(SafeDistributedModel, log_update_stats=True)
    model.compile(keras.optimizers.SGD(1.0), "mse")
    history = model.fit(x, y, batch_size=10, verbose=0)
    assert history.history["grad_norm"][0] == pytest.approx(expected, rel=1e-5)


def test_global_clipnorm_matches_one_device_clipping(devices, norm_sum):
    x, y, _ = regression_data(10, features=64)
    gradient = _stock_gradient(x, y)
    norm = _norm(gradient)
    limit = norm / 4
    model = _wide_mlp(SafeDistributedModel, global_clipnorm=limit)
    before = model.get_weights()
    model.compile(keras.optimizers.SGD(1.0), "mse")
    model.fit(x, y, batch_size=10, verbose=0)
    for b, a, g in zip(before, model.get_weights(), gradient):
        np.testing.assert_allclose(b - a, g * (limit / norm), rtol=1e-4, atol=1e-7)


def test_the_global_norm_joins_the_gradients_on_a_gpu_only_and_never_sharded_ones(
    devices, monkeypatch
):
    replicated = [jax.device_put(np.ones((4, 4), "float32"))]
    assert _jax_gradients.platform(replicated) == "cpu"
    assert not _jax_gradients.joins_norm(replicated)  # the default on a CPU
    monkeypatch.setattr(_jax_gradients, "_JOINED_NORM_PLATFORMS", frozenset({"cpu"}))
    assert _jax_gradients.joins_norm(replicated)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    sharded = jax.device_put(
        np.ones((4, 4), "float32"),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model")),
    )
    assert not _jax_gradients.joins_norm([*replicated, sharded])
    monkeypatch.setattr(_jax_gradients, "NORM_BY_CONCATENATION", True)
    assert not _jax_gradients.joins_norm([*replicated, sharded])  # the join would gather them
    tensors = [np.arange(12, dtype="float32").reshape(3, 4), np.full((5,), -2.0, "float16")]
    expected = np.sqrt(sum(np.sum(np.square(t.astype("float64"))) for t in tensors))
    for joined in (False, True):
        norm = _jax_gradients.global_norm([jax.numpy.asarray(t) for t in tensors], joined)
        assert norm.dtype == np.float32
        assert float(norm) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("accumulation", [1, 2], ids=["k1", "k2"])
def test_without_skip_or_statistics_the_step_matchesone_device(devices, accumulation):
    # Nothing reads the gradient norm here, so the step computes none.
    x, y, _ = regression_data(24, features=64)

    def stock():
        reference = _wide_mlp(keras.Model)
        reference.compile(keras.optimizers.SGD(0.05), "mse")
        reference.fit(x, y, batch_size=24, verbose=0)
        return reference

    reference = one_device(stock)
    model = _wide_mlp(
        SafeDistributedModel, skip_nonfinite=False, gradient_accumulation_steps=accumulation
    )
    model.compile(keras.optimizers.SGD(0.05), "mse")
    # With k=2, two micro-batches of 12 make one update of the 24 samples.
    batch = 24 if accumulation == 1 else 12
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    assert model._update_engine._reads_norm() is False
    assert _relative_error(model, reference) < 1e-5


class _StatsRequest(keras.callbacks.Callback):
    requests_update_stats = True


def test_partial_group_statistics_follow_a_request_between_fits(devices):
    # The epoch-end flush is compiled apart from the step: when a callback
    # asks for the statistics in a later fit(), the flush reads the norm too.
    x, y, _ = regression_data(24, features=64)
    model = _wide_mlp(SafeDistributedModel, skip_nonfinite=False, gradient_accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert "grad_norm" not in history.history
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(
        x[16:], y[16:], batch_size=8, shuffle=False, verbose=0, callbacks=[_StatsRequest()]
    )
    # One micro-batch of 8: the partial group, applied at the epoch's end with SGD(0.05).
    step = [b - a for b, a in zip(before, model.get_weights())]
    expected = _norm(s / 0.05 for s in step)
    assert history.history["grad_norm"][0] == pytest.approx(expected, rel=1e-4)


def test_update_statistics_and_steps_per_execution(devices):
    x, y, _ = regression_data(40)
    results = []
    for steps in (1, 4):
        model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2, log_update_stats=True)
        model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=steps)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((model.get_weights(), history.history))
    (weights_1, history_1), (weights_4, history_4) = results
    for a, b in zip(weights_1, weights_4):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # 5 micro-batches of 8: two updates of 16, then the partial group of 8.
    assert history_1["samples_per_update"] == [8.0, 8.0]
    assert history_1["samples_per_update_mean"] == pytest.approx([40 / 3] * 2)
    assert history_4["samples_per_update_mean"] == history_1["samples_per_update_mean"]
    assert history_1["grad_norm"] == pytest.approx(history_4["grad_norm"], rel=1e-5)


def test_embedding_with_adam_and_accumulation(devices):
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, 20, size=(30, 6)).astype("int32")
    tokens[:, 4:] = 0  # padding, masked
    targets = rng.normal(size=(30, 1)).astype("float32")

    def build(model_class, **options):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((6,), dtype="int32")
        embedded = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
        pooled = keras.layers.GlobalAveragePooling1D()(embedded)
        outputs = keras.layers.Dense(1)(pooled)
        if model_class is keras.Model:
            return keras.Model(inputs, outputs)
        return SafeDistributedModel(inputs, outputs, **options)

    def stock():
        reference = build(keras.Model)
        reference.compile(keras.optimizers.Adam(0.01), "mse")
        reference.fit(tokens, targets, batch_size=30, epochs=3, shuffle=False, verbose=0)
        return reference

    reference = one_device(stock)
    model = build(SafeDistributedModel, gradient_accumulation_steps=3)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(tokens, targets, batch_size=11, epochs=3, shuffle=False, verbose=0)

    assert _relative_error(model, reference) < 1e-5


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_with_accumulation(devices, policy):
    x, y, _ = regression_data(34)
    keras.config.set_dtype_policy(policy)
    reference = _stock_fit(x, y, 34, epochs=2)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=3)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # As on TensorFlow (tests/test_model_dtypes.py): the rounding of one
    # float16 or bfloat16 batch against three micro-batches.
    assert _relative_error(model, reference) < (5e-3 if policy == "mixed_float16" else 5e-2)


@pytest.mark.parametrize("policy", ["float32", "bfloat16"])
def test_accumulation_dtype_bfloat16_keeps_bfloat16_sums(devices, policy):
    x, y, _ = regression_data(34)
    keras.config.set_dtype_policy(policy)
    reference = _stock_fit(x, y, 34, epochs=2)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=3, accumulation_dtype="bfloat16")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)

    sums = model._update_engine.sums
    assert [s.dtype for s in sums] == ["bfloat16"] * len(model.trainable_variables)
    # Each micro-batch's gradient rounded into bfloat16 (8 bits of mantissa).
    # Measured: 7.5e-3 for float32 weights (float32 sums: 4.5e-8); 4.5e-2 for
    # bfloat16 weights (float32 sums: 1.5e-2), where stock Keras itself, fed
    # each batch's samples in reverse order, ends 0.12 from its own weights.
    if policy == "float32":
        assert _relative_error(model, reference) < 1e-2
    else:
        order = np.arange(34)[::-1].copy()
        reordered = _stock_fit(x[order], y[order], 34, epochs=2)
        assert _relative_error(model, reference) < _relative_error(reordered, reference)


def test_weight_and_activity_regularization(devices):
    x, y, _ = regression_data(34)

    def build(model_class, **options):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(
            8, kernel_regularizer=keras.regularizers.L2(0.01),
            activity_regularizer=keras.regularizers.L1(0.01),
        )(inputs)
        outputs = keras.layers.Dense(1)(hidden)
        if model_class is keras.Model:
            return keras.Model(inputs, outputs)
        return SafeDistributedModel(inputs, outputs, **options)

    def stock():
        reference = build(keras.Model)
        reference.compile(keras.optimizers.SGD(0.1), "mse")
        history = reference.fit(x, y, batch_size=34, epochs=2, shuffle=False, verbose=0)
        return reference, history.history["loss"]

    reference, expected = one_device(stock)
    model = build(SafeDistributedModel, gradient_accumulation_steps=3)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    assert _relative_error(model, reference) < 1e-5
    # The logged loss has the weight penalty of the weights each micro-batch
    # ran with, as stock's has its batch's (read after the update, it was
    # 2e-3 off with L2(0.01)).
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)


def test_logged_loss_has_the_penalty_of_the_weights_the_batch_ran_with(devices):
    x, y, _ = regression_data(32)

    def build(model_class):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.5))(inputs)
        return model_class(inputs, keras.layers.Dense(1)(hidden))

    def stock():
        reference = build(keras.Model)
        reference.compile(keras.optimizers.SGD(0.1), "mse")
        history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return reference, history.history["loss"], reference.train_on_batch(x[:8], y[:8])

    reference, expected, expected_batch = one_device(stock)
    model = build(SafeDistributedModel)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)
    assert model.train_on_batch(x[:8], y[:8]) == pytest.approx(expected_batch, rel=1e-5)
    assert _relative_error(model, reference) < 1e-5


def test_a_pending_group_is_applied_when_an_option_changes(devices):
    x, y, _ = regression_data(16)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = [w.copy() for w in model.get_weights()]
    model.train_on_batch(x[:8], y[:8])
    for after, old in zip(model.get_weights(), before):
        np.testing.assert_array_equal(after, old)

    model.clipnorm = 1.0

    reference = _stock_fit(x[:8], y[:8], 8)
    assert _relative_error(model, reference) < 1e-5


class _Interrupt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise KeyboardInterrupt


@pytest.mark.parametrize("how", ["train_on_batch", "interrupted fit"])
def test_a_pending_group_is_applied_when_fit_begins(devices, how):
    # It was carried into the fit's first group, shifting every group after it.
    x, y, _ = regression_data(40)

    def stock():
        reference = _mlp(keras.Model)
        reference.compile(keras.optimizers.SGD(0.1), "mse")
        reference.train_on_batch(x[:8], y[:8])
        reference.fit(x[8:], y[8:], batch_size=16, epochs=1, shuffle=False, verbose=0)
        return reference

    reference = one_device(stock)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    # The first micro-batch of 8 samples left pending: half a group.
    if how == "train_on_batch":
        model.train_on_batch(x[:8], y[:8])
    else:
        with pytest.raises(KeyboardInterrupt):
            model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0, callbacks=[_Interrupt()])
    model.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3
    assert _relative_error(model, reference) < 1e-5


def test_a_group_pending_from_train_on_batch_is_applied_when_compile_is_called_again(devices):
    x, y, _ = regression_data(8)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.train_on_batch(x, y)  # half a group
    model.compile(keras.optimizers.SGD(0.1), "mse")
    assert _relative_error(model, _stock_fit(x, y, 8)) < 1e-5


def test_a_pending_group_is_named_when_saved_and_dropped_when_weights_are_loaded(devices, tmp_path):
    x, y, _ = regression_data(24)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)  # nothing pending yet: no word
    model.train_on_batch(x[:8], y[:8])  # half a group
    with pytest.warns(UserWarning, match=r"save\(\): 1 micro-batch\(es\) of a gradient accumulation group of 2"):
        model.save(str(tmp_path / "model.keras"))
    with pytest.warns(UserWarning, match=r"load_weights\(\) dropped 1 micro-batch\(es\)"):
        model.load_weights(path)
    model.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    # The loaded weights are the initial ones: one update of the 16 samples.
    assert _relative_error(model, _stock_fit(x[8:], y[8:], 16)) < 1e-5


def _two_dense(model_class, **options):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    first = keras.layers.Dense(8, name="first")
    second = keras.layers.Dense(3, name="second")
    outputs = second(first(inputs))
    if model_class is keras.Model:
        return keras.Model(inputs, outputs), first, second
    return SafeDistributedModel(inputs, outputs, **options), first, second


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainable_changed_without_compile_is_refused_by_name(devices, accumulation):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")
    model, first, second = _two_dense(
        SafeDistributedModel, gradient_accumulation_steps=accumulation
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    first.trainable = False
    model.fit(x, y, batch_size=8 // accumulation, shuffle=False, verbose=0)
    # The same count of variables, other shapes: stock fails in the step.
    first.trainable, second.trainable = True, False
    weights = [w.copy() for w in model.get_weights()]

    with pytest.raises(ValueError) as error:
        model.fit(x, y, batch_size=8 // accumulation, shuffle=False, verbose=0)

    message = str(error.value)
    assert "(2 then, 2 now; now trainable: first/kernel, first/bias; no longer trainable: " \
        "second/kernel, second/bias)" in message
    assert "Call model.compile(...) again after setting a layer's `trainable`" in message
    for after, before in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(after, before)  # nothing trained
    with pytest.raises(ValueError, match="2 then, 2 now"):
        model.train_on_batch(x[:8], y[:8])


def test_stock_keras_fails_inside_the_step_when_trainable_changes_without_compile():
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    model, first, _ = _two_dense(keras.Model)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, x[:, :3], batch_size=8, verbose=0)
    first.trainable = False

    with pytest.raises(ValueError, match="corresponding 1:1 to the trainable variables"):
        model.fit(x, x[:, :3], batch_size=8, verbose=0)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_after_compile_again_a_changed_trainable_set_matchesone_device(devices, accumulation):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")

    def train(model, first, second, batch_size):
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        first.trainable = False
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        first.trainable, second.trainable = True, False
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        return model

    reference = one_device(lambda: train(*_two_dense(keras.Model), 8))
    model = train(
        *_two_dense(SafeDistributedModel, gradient_accumulation_steps=accumulation),
        8 // accumulation,
    )

    assert _relative_error(model, reference) < 1e-5


def test_save_and_load_keeps_options_and_weights(tmp_path, devices):
    x, y, _ = regression_data(16)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2, global_clipnorm=1.0)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)

    loaded = keras.models.load_model(path)

    assert isinstance(loaded, SafeDistributedModel)
    assert (loaded.gradient_accumulation_steps, loaded.global_clipnorm) == (2, 1.0)
    assert _relative_error(loaded, model) == 0.0


_SAVE_ON_TENSORFLOW = """
import sys
import keras, numpy as np
from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.backend.jax import _update as _jax_update
if sys.argv[1] == "save":
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=3)
    model.compile("adam", "mse")
    model.fit(np.ones((6, 4), "float32"), np.ones((6, 1), "float32"), verbose=0)
    model.save(sys.argv[2])
    np.save(sys.argv[2] + ".npy", model.get_weights()[0])
else:
    model = keras.models.load_model(sys.argv[2])
    assert model.gradient_accumulation_steps == 5, model.gradient_accumulation_steps
    print(float(model.get_weights()[0].sum()))
"""


def _tensorflow(args):
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-c", _SAVE_ON_TENSORFLOW, *args],
        env=env, capture_output=True, text=True, timeout=240, check=True,
    )


@needs_tensorflow
def test_a_model_saved_on_tensorflow_loads_on_jax_and_back(tmp_path):
    saved = tmp_path / "from_tensorflow.keras"
    _tensorflow(["save", str(saved)])

    loaded = keras.models.load_model(saved)

    assert isinstance(loaded, SafeDistributedModel)
    assert loaded.gradient_accumulation_steps == 3
    np.testing.assert_array_equal(loaded.get_weights()[0], np.load(str(saved) + ".npy"))
    loaded.gradient_accumulation_steps = 5
    back = tmp_path / "from_jax.keras"
    loaded.save(back)
    printed = _tensorflow(["load", str(back)]).stdout.strip().splitlines()[-1]
    assert float(printed) == pytest.approx(float(loaded.get_weights()[0].sum()), rel=1e-6)


@needs_tensorflow
def test_on_tensorflow_the_package_works_without_jax():
    # TensorFlow imports jax itself when it is installed; so jax is made
    # unimportable, and the package must still import and pick TensorFlow's step.
    env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
    env.pop("XLA_FLAGS", None)
    code = (
        "import sys; sys.modules['jax'] = None; import keras_safe_dist; "
        "print(keras_safe_dist.model.Trainer.__module__, "
        "'keras_safe_dist.backend.jax' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.stdout.strip().splitlines()[-1:] == [
        "keras_safe_dist.backend.tensorflow.trainer False"
    ], result.stderr[-2000:]


def test_the_jax_trainer_is_the_backend_in_use():
    assert keras_safe_dist.model.Trainer.__module__ == "keras_safe_dist.backend.jax.trainer"
    assert len(jax.devices()) == 2


def test_convnet_with_batchnorm_and_dropout_matchesone_device(devices):
    # On JAX the Dropout mask of a global batch does not depend on how the batch
    # is sharded, so, without accumulation, the convnet matches one device too.
    rng = np.random.default_rng(7)
    images = rng.normal(size=(33, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 3, size=(33,)).astype("int32")

    def build(model_class):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8, 8, 1))
        hidden = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
        hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.Flatten()(keras.layers.MaxPooling2D()(hidden))
        hidden = keras.layers.Dropout(0.3)(hidden)
        outputs = keras.layers.Dense(3)(hidden)
        model = model_class(inputs, outputs)
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    def stock():
        reference = build(keras.Model)
        reference.fit(images, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return reference

    reference = one_device(stock)
    model = build(SafeDistributedModel)
    model.fit(images, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)

    assert _relative_error(model, reference) < 1e-5


def test_fit_evaluate_and_predict_on_zero_samples_raise(devices):
    model = _mlp(SafeDistributedModel)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((0, 4), "float32"), np.zeros((0, 1), "float32")
    for method, args in (("fit", (x, y)), ("evaluate", (x, y)), ("predict", (x,))):
        with pytest.raises(ValueError, match=rf"SafeDistributedModel.{method}\(\) received x that holds no samples"):
            getattr(model, method)(*args, verbose=0)

    class Empty(keras.utils.PyDataset):
        def __len__(self):
            return 0

        def __getitem__(self, index):
            raise IndexError(index)

    # Stock Keras on JAX: a bare StopIteration (a TypeError from predict()).
    for method in ("fit", "evaluate", "predict"):
        with pytest.raises(ValueError, match=r"received x that holds no samples.*of 0 batches"):
            getattr(model, method)(Empty(), verbose=0)
    # Stock Keras: a whole epoch's steps first, then an error about evaluate().
    with pytest.raises(ValueError, match=r"received validation_data that holds no samples"):
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), validation_data=(x, y), verbose=0)
    assert int(model.optimizer.iterations) == 0


# A model built before keras.distribution.set_distribution(...) (JAX002).


def _built_before_the_distribution():
    """A model built on one device, then compiled under DataParallel over both devices."""
    keras.distribution.set_distribution(None)
    model = _mlp(SafeDistributedModel)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_a_model_built_before_the_distribution_is_laid_out_once_and_trains_exactly():
    x, y, _ = regression_data(32)
    reference = _stock_fit(x, y, 32, epochs=2)
    model = _built_before_the_distribution()
    with pytest.warns(UserWarning) as caught:
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught if "JAX002" in str(w.message)]
    kernel, bias, out_kernel = (v.path for v in model.trainable_variables[:3])
    # The model's 4 variables, of the 8 of the model, optimizer and metrics (the update
    # engine is created after they are laid out); not the optimizer's or the metrics'.
    assert messages == [
        f"SafeDistributedModel '{model.name}': 4 of 8 variables of the model, optimizer and "
        "metrics are not laid out as DataParallel over 2 devices lays out their variables "
        f"({kernel} is on cpu:0, not P(None, None) over 2 devices; {bias} is on cpu:0, "
        f"not P(None,) over 2 devices; {out_kernel} is on cpu:0, not P(None, None) over 2 "
        "devices; and 1 more): they were created before "
        "`keras.distribution.set_distribution(...)` (or outside `distribution.scope()`, or "
        "under another distribution), so they stay where they were created. They are now laid out on the distribution, once, with "
        "their values unchanged (JAX002). Call `keras.distribution.set_distribution(...)` "
        "before creating the model, the optimizer and the metrics (or create them under "
        "`distribution.scope()`)."
    ]
    assert _relative_error(model, reference) < 1e-5
    kernel = model.trainable_variables[0]
    assert len(kernel.value.sharding.device_set) == 2
    assert keras_safe_dist.audit(model).codes() == ("JAX001",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=32, verbose=0)  # laid out already: no second warning
    kernel.assign(np.zeros(kernel.shape, "float32"))  # later assignments keep the layout
    assert len(kernel.value.sharding.device_set) == 2


def test_evaluate_and_predict_lay_out_a_model_built_before_the_distribution():
    x, y, _ = regression_data(8)
    model = _built_before_the_distribution()
    with pytest.warns(UserWarning, match="JAX002"):
        loss = model.evaluate(x, y, batch_size=8, verbose=0)
    assert np.isfinite(loss)
    assert model.predict(x, batch_size=8, verbose=0).shape == (8, 1)


def test_with_several_processes_a_model_built_before_the_distribution_is_refused(monkeypatch):
    from keras_safe_dist.backend.jax import variable_layout

    model = _built_before_the_distribution()
    monkeypatch.setattr(variable_layout.jax, "process_count", lambda: 2)
    with pytest.raises(ValueError) as raised:
        variable_layout.lay_out(model)
    message = str(raised.value)
    assert message.startswith(f"SafeDistributedModel '{model.name}': 4 of ")
    assert (
        "With 2 processes each holds its own values, which cannot be laid out as one array "
        "without knowing they agree (JAX002). Call `keras.distribution.set_distribution(...)` "
        "before creating the model"
    ) in message
    assert len(model.trainable_variables[0].value.sharding.device_set) == 1


# The optimizer options SafeDistributedModel refuses, explained in JAX's terms.


@pytest.mark.parametrize("option", [{"global_clipnorm": 1.0}, {"clipnorm": 1.0}, {"clipvalue": 0.5}])
def test_an_optimizer_that_clips_is_refused_with_the_reason_on_jax(option):
    model = _mlp(SafeDistributedModel)
    ((name, value),) = option.items()
    with pytest.raises(ValueError) as raised:
        model.compile(keras.optimizers.SGD(0.1, name="sgd", **option), "mse")
    assert str(raised.value) == (
        f"The optimizer passed to SafeDistributedModel.compile() sets `{name}={value!r}`, "
        "which clips inside the optimizer, after SafeDistributedModel has accumulated the "
        "update, where its update statistics (`grad_norm`, `clip_rate`) do not see it (on "
        "JAX the optimizer clips the gradient reduced over all devices, as on one device; on "
        "TensorFlow the same option clips each replica's gradient before the all-reduce). "
        f"Pass `{name}` to SafeDistributedModel(...) instead and leave it unset on the "
        "optimizer. Received optimizer: sgd"
    )


def test_an_optimizer_that_accumulates_is_refused_without_tensorflow_terms():
    model = _mlp(SafeDistributedModel)
    with pytest.raises(ValueError) as raised:
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, name="sgd"), "mse")
    assert str(raised.value) == (
        "The optimizer passed to SafeDistributedModel.compile() sets "
        "`gradient_accumulation_steps=2`, which would average SafeDistributedModel's updates "
        "again inside the optimizer, each with the same weight, so an update of fewer samples "
        "(the end of an epoch) counts as much as a full one, and the update statistics would "
        "count updates the optimizer does not apply. Pass `gradient_accumulation_steps` to "
        "SafeDistributedModel(...) instead and leave it unset on the optimizer. Received "
        "optimizer: sgd"
    )


def test_a_model_fitted_under_one_distribution_then_another_is_laid_out_again():
    # Before (stock Keras too): "Received incompatible devices for jitted computation".
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    x, y, _ = regression_data(16)
    inputs = keras.Input((4,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:1]))
    with pytest.warns(UserWarning, match=r"or under another distribution\), so they stay where they were created.*JAX002"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert model.trainable_variables[0].value.sharding.device_set == {jax.devices()[0]}
    assert np.isfinite(model.evaluate(x, y, verbose=0))
