"""Clipping after the all-reduce, non-finite skipping, one all-reduce per update, loss scaling."""

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib

from keras_safe_dist import SafeDistributedModel

from conftest import regression_data
from conftest import relative_error
from conftest import strategy_for

TOLERANCE = 1e-5


def dense_twins(replicas, optimizer, stock_optimizer, **options):
    """Optimizers are given as factories: each must be created in its scope."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    stock = keras.Model(inputs, keras.layers.Dense(2, activation="tanh")(inputs))
    stock.compile(optimizer=stock_optimizer(), loss="mse")
    with strategy_for(replicas).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(
            inputs, keras.layers.Dense(2, activation="tanh")(inputs), log_update_stats=True, **options
        )
        model.compile(optimizer=optimizer(), loss="mse")
        model.set_weights(stock.get_weights())
    return stock, model


@pytest.mark.parametrize("mode,limit", [("global_clipnorm", 0.05), ("clipnorm", 0.05), ("clipvalue", 0.01)])
@pytest.mark.parametrize("steps", [1, 2])
def test_clipping_once_after_reduction_and_accumulation(replicas, mode, limit, steps):
    x, y, _ = regression_data(36, outputs=2)
    y = y * 10
    stock, model = dense_twins(
        replicas,
        lambda: keras.optimizers.SGD(1.0),
        lambda: keras.optimizers.SGD(1.0, **{mode: limit}),
        gradient_accumulation_steps=steps,
        **{mode: limit},
    )
    stock.fit(x, y, batch_size=12 * steps, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    assert relative_error(stock.get_weights(), model.get_weights()) < TOLERANCE
    assert history["clip_rate"] == [1.0, 1.0]


def test_global_clipnorm_bounds_update_norm_on_two_replicas():
    x, y, _ = regression_data(64, outputs=2)
    _, model = dense_twins(2, lambda: keras.optimizers.SGD(1.0), lambda: "sgd", global_clipnorm=1.0)
    before = model.get_weights()
    model.fit(x, y * 100, batch_size=64, epochs=1, verbose=0)
    update = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(before, model.get_weights())))
    assert update == pytest.approx(1.0, rel=1e-5)


def poisoned(samples, bad_index):
    x, y, _ = regression_data(samples, outputs=2)
    y[bad_index] = np.nan
    return x, y


@pytest.mark.parametrize("steps", [1, 2])
def test_nonfinite_update_leaves_weights_and_adam_state_untouched(replicas, steps):
    # Two groups of 16 samples; the second holds a NaN target on one replica's share.
    x, y = poisoned(32, bad_index=16 + 3)
    stock, model = dense_twins(
        replicas, lambda: keras.optimizers.Adam(0.1), lambda: keras.optimizers.Adam(0.1),
        gradient_accumulation_steps=steps,
    )
    stock.fit(x[:16], y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=16 // steps, epochs=1, shuffle=False, verbose=0).history
    assert history["skipped_updates"] == [1.0]
    assert relative_error(stock.get_weights(), model.get_weights()) < TOLERANCE
    assert int(model.optimizer.iterations.numpy()) == 1
    stock_state = [v.numpy() for v in stock.optimizer.variables]
    state = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    assert relative_error(stock_state[1:], state[1:]) < TOLERANCE
    # Every replica kept identical weights: they took the same decision.
    for variable in model.trainable_weights:
        copies = model.distribute_strategy.experimental_local_results(variable.value)
        for copy in copies[1:]:
            np.testing.assert_array_equal(copies[0].numpy(), copy.numpy())


def test_accumulators_reset_after_skipped_update():
    x, y = poisoned(48, bad_index=0)
    stock, model = dense_twins(2, lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.SGD(0.1), gradient_accumulation_steps=2)
    stock.fit(x[16:], y[16:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert relative_error(stock.get_weights(), model.get_weights()) < TOLERANCE


def test_skip_nonfinite_false_applies_the_update():
    x, y = poisoned(16, bad_index=0)
    _, model = dense_twins(1, lambda: keras.optimizers.SGD(0.1), lambda: "sgd", skip_nonfinite=False)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    assert history["skipped_updates"] == [0.0]
    assert not np.all(np.isfinite(model.get_weights()[0]))


def test_one_all_reduce_per_update(monkeypatch):
    calls = []
    original = distribute_lib.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append(len(tf.nest.flatten(value)))
        return original(self, reduce_op, value, options)

    monkeypatch.setattr(distribute_lib.ReplicaContext, "all_reduce", counting)
    x, y, _ = regression_data(48, outputs=2)
    _, model = dense_twins(2, lambda: keras.optimizers.SGD(0.1), lambda: "sgd", gradient_accumulation_steps=3)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # Two graphs are traced, the train step and the epoch-end flush. Each holds
    # one batched all-reduce per replica (two gradients plus the loss totals),
    # inside the cross-replica branch that runs once per update; the micro-batch
    # path and the optimizer add none.
    assert calls == [3, 3, 3, 3]
    assert int(model.optimizer.iterations.numpy()) == 2


def test_mixed_float16_keeps_dynamic_loss_scaling():
    keras.config.set_dtype_policy("mixed_float16")
    x, y, _ = regression_data(64, outputs=2)
    stock, model = dense_twins(
        2,
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**40, dynamic_growth_steps=2),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**40, dynamic_growth_steps=2),
        gradient_accumulation_steps=2,
    )
    stock.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    # Overflowing updates were skipped and halved the scale, as in stock Keras.
    assert float(model.optimizer.dynamic_scale.numpy()) == float(stock.optimizer.dynamic_scale.numpy())
    assert float(model.optimizer.dynamic_scale.numpy()) < 2.0**40
    assert int(model.optimizer.iterations.numpy()) == int(stock.optimizer.iterations.numpy())
    assert history["skipped_updates"][-1] == 4 - int(model.optimizer.iterations.numpy())
    assert relative_error(stock.get_weights(), model.get_weights()) < 1e-3


def test_jit_compile_on_one_device():
    x, y, _ = regression_data(40, outputs=2)
    stock, model = dense_twins(1, lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.SGD(0.1), gradient_accumulation_steps=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    stock.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert model.jit_compile is True
    assert relative_error(stock.get_weights(), model.get_weights()) < TOLERANCE


def _conv_classifier(float32_output):
    inputs = keras.Input((28, 28, 1))
    hidden = keras.layers.Flatten()(keras.layers.Conv2D(8, 3)(inputs))
    dtype = "float32" if float32_output else None
    return inputs, keras.layers.Dense(10, activation="softmax", dtype=dtype)(hidden)


@pytest.mark.parametrize("float32_output", [False, True], ids=["float16_output", "float32_output"])
def test_mixed_float16_accumulation_scales_gradients_as_stock(replicas, float32_output):
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(96, 28, 28, 1)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, size=96), 10)
    fit_kwargs = dict(epochs=1, shuffle=False, verbose=0)
    if float32_output:
        fit_kwargs["class_weight"] = {k: 1.0 + k / 10 for k in range(10)}
    keras.utils.set_random_seed(1)
    stock = keras.Model(*_conv_classifier(float32_output))
    stock.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
    with strategy_for(replicas).scope():
        keras.utils.set_random_seed(1)
        model = SafeDistributedModel(*_conv_classifier(float32_output), gradient_accumulation_steps=4, log_update_stats=True)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
        model.set_weights(stock.get_weights())
    scales = []
    for _ in range(2):
        stock.fit(x, y, batch_size=32, **fit_kwargs)
        history = model.fit(x, y, batch_size=8, **fit_kwargs).history
        scales.append((float(stock.optimizer.dynamic_scale.numpy()), float(model.optimizer.dynamic_scale.numpy())))
    # Keras's default initial scale: no update overflows, on either side.
    assert int(model.optimizer.iterations.numpy()) == int(stock.optimizer.iterations.numpy()) == 6
    assert history["skipped_updates"] == [0.0]
    assert [ours for ours, _ in scales] == [theirs for _, theirs in scales]
    assert relative_error(stock.get_weights(), model.get_weights()) < 2e-3


@pytest.mark.parametrize("steps", [1, 2])
def test_first_skipped_update_of_a_fit_warns_once(replicas, steps):
    x, y, _ = regression_data(64, outputs=2)
    x[20, 1] = np.nan  # in micro-batch 2
    _, model = dense_twins(replicas, lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.SGD(0.1),
                           gradient_accumulation_steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    skipped = [w for w in caught if "skipped a non-finite update" in str(w.message)]
    # Attributed to the fit() call above, not to Keras's callback list.
    assert [w.filename for w in skipped] == [__file__]
    messages = [str(w.message) for w in skipped]
    where = "batch 2" if steps == 1 else "update 1 (micro-batches 2 to 3)"
    samples = 8 * steps
    assert messages == [
        f"SafeDistributedModel skipped a non-finite update at epoch 0, {where}: the gradient or loss of its "
        f"{samples} samples was NaN or infinite (or the gradient's global norm passed float32's range, about "
        "1.8e19), so they did not change the weights. Further skips in this fit() "
        "are counted without a warning (`skipped_updates` with `log_update_stats=True`). To find where the "
        "non-finite value began, add keras_safe_dist.callbacks.NaNOnsetDetector() to fit()'s callbacks."
    ]
    assert history["skipped_updates"] == [1.0, 2.0]
    assert np.isfinite(np.concatenate([w.ravel() for w in model.get_weights()])).all()


def test_a_finite_gradient_whose_norm_passes_float32s_range_is_skipped_as_documented():
    # Loss 1e30 and a gradient of -2e25 on a float32 kernel of two weights: the
    # squared norm overflows. Stock applies the update; the safe model skips it.
    x = np.full((8, 2), 1e10, "float32")
    y = np.full((8, 1), 1e15, "float32")

    def build(cls):
        inputs = keras.Input((2,))
        model = cls(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
        model.compile(keras.optimizers.SGD(1e-25), "mse")
        return model

    stock = build(keras.Model)
    stock.fit(x, y, batch_size=8, verbose=0)
    assert stock.get_weights()[0] == pytest.approx(np.full((2, 1), 2.0), rel=1e-5)  # 1e-25 x 2e25 applied
    model = build(SafeDistributedModel)
    model.log_update_stats = True
    with pytest.warns(UserWarning, match="global norm passed float32's range"):
        history = model.fit(x, y, batch_size=8, verbose=0).history
    assert history["skipped_updates"] == [1.0] and history["grad_norm"] == [float("inf")]
    np.testing.assert_array_equal(model.get_weights()[0], np.zeros((2, 1)))


def test_healthy_fit_and_loss_scale_overflows_do_not_warn():
    keras.config.set_dtype_policy("mixed_float16")
    x, y, _ = regression_data(64, outputs=2)
    _, model = dense_twins(
        1,
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**40),
        lambda: keras.optimizers.SGD(0.1),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    assert history["skipped_updates"][0] > 0  # overflows of the initial scale
    assert not [w for w in caught if "skipped a non-finite update" in str(w.message)]


@pytest.mark.parametrize("skip", [False, True], ids=["healthy", "one_skipped"])
def test_epoch_spread_of_grad_norm_and_samples_covers_every_applied_update(replicas, skip):
    # 500 samples, micro-batches of 32, groups of 3: five groups of 96 and a
    # last group of 20. The plain statistics hold the last update only.
    x, y, _ = regression_data(500)
    if skip:
        y[100] = np.nan  # in the second group: that update is skipped
    steps, batch = 3, 32
    with strategy_for(replicas).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(
            inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=steps, log_update_stats=True
        )
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # fixed weights
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0).history
    # Each group's samples and gradient norm, on one device from the data.
    size = steps * batch
    groups = [slice(start, min(start + size, len(x))) for start in range(0, len(x), size)]
    applied = [g for g in groups if np.isfinite(y[g]).all()]
    samples = [g.stop - g.start for g in applied]
    norms = []
    for g in applied:
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y[g], model(x[g]))
            loss = tf.reduce_mean(loss)
        norms.append(float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_weights))))
    assert samples[-1] == 20 and max(samples) == 96
    for epoch in range(2):  # the spread starts again each epoch
        assert history["samples_per_update"][epoch] == 20
        assert history["samples_per_update_min"][epoch] == min(samples)
        assert history["samples_per_update_max"][epoch] == max(samples)
        assert history["samples_per_update_mean"][epoch] == pytest.approx(np.mean(samples), rel=1e-6)
        assert history["grad_norm"][epoch] == pytest.approx(norms[-1], rel=1e-5)
        assert history["grad_norm_min"][epoch] == pytest.approx(min(norms), rel=1e-5)
        assert history["grad_norm_max"][epoch] == pytest.approx(max(norms), rel=1e-5)
        assert history["grad_norm_mean"][epoch] == pytest.approx(np.mean(norms), rel=1e-5)
        assert history["skipped_updates"][epoch] == (epoch + 1 if skip else 0)


def test_models_built_one_after_another_do_not_warn_of_the_flushs_retracing():
    # TensorFlow counts the traces of every tf.function of one code object
    # together: five models with accumulation used to warn that the epoch-end
    # flush "triggered tf.function retracing" (each traced it once, as it must).
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    tf.get_logger().addHandler(handler)
    try:
        x, y, _ = regression_data(12)
        for _ in range(5):
            inputs = keras.Input((x.shape[1],))
            model = SafeDistributedModel(
                inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=2
            )
            model.compile(optimizer="sgd", loss="mse")
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)
            assert model._update_engine.flush_function.experimental_get_tracing_count() == 1
    finally:
        tf.get_logger().removeHandler(handler)
    assert [m for m in messages if "retracing" in m and "_flush" in m] == []
