"""Every update equals stock Keras on one device with one batch per group."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import _compat

from conftest import regression_data
from conftest import relative_error
from conftest import strategy_for

TOLERANCE = 1e-5


def mlp(inputs, regularizer=None):
    hidden = keras.layers.Dense(
        3, activation="tanh", kernel_regularizer=regularizer, name="hidden"
    )(inputs)
    return keras.layers.Dense(1, name="out")(hidden)


def twins(replicas, build, compile_kwargs, **options):
    """A stock reference on one device and a SafeDistributedModel, same weights.

    The model logs its update statistics unless `log_update_stats=False`.
    """
    options.setdefault("log_update_stats", True)
    keras.utils.set_random_seed(7)
    inputs, outputs = build()
    reference = keras.Model(inputs, outputs)
    reference.compile(**compile_kwargs())
    with strategy_for(replicas).scope():
        inputs, outputs = build()
        model = SafeDistributedModel(inputs=inputs, outputs=outputs, **options)
        model.compile(**compile_kwargs())
        model.set_weights(reference.get_weights())
    return reference, model


def assert_matches_big_batch(reference, model, x, y, batch, steps, **fit_kwargs):
    """Fits the reference with one batch per group and the model with micro-batches."""
    fit_kwargs = dict(epochs=2, shuffle=False, verbose=0, **fit_kwargs)
    reference.fit(x, y, batch_size=batch * steps, **fit_kwargs)
    history = model.fit(x, y, batch_size=batch, **fit_kwargs)
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    return history


def sgd_mse():
    return dict(optimizer=keras.optimizers.SGD(0.1), loss="mse")


def sgd_mse_reduced(reduction, **compile_kwargs):
    """A maker of compile() arguments: SGD(0.01) and an MSE with `reduction`."""
    return lambda: dict(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.MeanSquaredError(reduction=reduction),
        **compile_kwargs,
    )


def simple():
    inputs = keras.Input((4,))
    return inputs, mlp(inputs)


# (samples, micro-batch): short last micro-batch; a last micro-batch of one
# sample (one replica gets none); odd micro-batches; a first batch smaller
# than the batch size.
SPLITS = [(80, 32), (65, 16), (45, 15), (7, 16)]


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("samples,batch", SPLITS)
def test_update_equals_one_big_batch(replicas, steps, samples, batch):
    weighted = samples % 2 == 1
    x, y, w = regression_data(samples)
    sample_weight = w if weighted else None
    reference, model = twins(
        replicas, simple, sgd_mse, gradient_accumulation_steps=steps
    )
    reference.fit(
        x, y, sample_weight=sample_weight, batch_size=batch * steps,
        epochs=2, shuffle=False, verbose=0,
    )
    history = model.fit(
        x, y, sample_weight=sample_weight, batch_size=batch,
        epochs=2, shuffle=False, verbose=0,
    )
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    groups = -(-samples // (batch * steps))
    assert int(model.optimizer.iterations.numpy()) == 2 * groups
    last_group = samples - (groups - 1) * batch * steps
    assert history.history["samples_per_update"][-1] == last_group


def test_replica_count_does_not_change_weights():
    x, y, _ = regression_data(65)
    weights = []
    for replicas in (1, 2):
        _, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=2)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert relative_error(weights[0], weights[1]) < TOLERANCE


def test_class_weight_matches_one_big_batch(replicas):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, 4)).astype("float32")
    y = rng.integers(0, 3, size=(50,))
    class_weight = {0: 0.5, 1: 2.0, 2: 1.0}

    def build():
        inputs = keras.Input((4,))
        return inputs, keras.layers.Dense(3, activation="softmax")(inputs)

    def compile_kwargs():
        return dict(
            optimizer=keras.optimizers.SGD(0.5),
            loss="sparse_categorical_crossentropy",
        )

    reference, model = twins(replicas, build, compile_kwargs, gradient_accumulation_steps=2)
    assert_matches_big_batch(reference, model, x, y, 12, 2, class_weight=class_weight)


def test_multiple_outputs_with_loss_weights(replicas):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(45, 4)).astype("float32")
    y_reg = rng.normal(size=(45, 2)).astype("float32")
    y_cls = rng.integers(0, 3, size=(45,))

    def build():
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5, activation="relu")(inputs)
        return inputs, {
            "reg": keras.layers.Dense(2, name="reg")(hidden),
            "cls": keras.layers.Dense(3, activation="softmax", name="cls")(hidden),
        }

    def compile_kwargs():
        return dict(
            optimizer=keras.optimizers.SGD(0.2),
            loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
            loss_weights={"reg": 0.3, "cls": 1.5},
        )

    targets = {"reg": y_reg, "cls": y_cls}
    reference, model = twins(replicas, build, compile_kwargs, gradient_accumulation_steps=3)
    assert_matches_big_batch(reference, model, x, targets, 10, 3)

    # Each output's logged loss is its loss over every sample, as stock Keras
    # on one device computes it in one batch (weights frozen). Each replica's
    # and micro-batch's value counted once, whatever its samples (as stock
    # Keras on TensorFlow counts each batch's): in a probe of 53 samples, up
    # to 0.18 off with a last micro-batch of one sample.
    def frozen():
        return dict(compile_kwargs(), optimizer=keras.optimizers.SGD(0.0))

    for steps, batch in ((1, 10), (2, 13)):
        reference, model = twins(replicas, build, frozen, gradient_accumulation_steps=steps)
        expected = reference.evaluate(x, targets, batch_size=45, verbose=0, return_dict=True)
        logged = model.fit(x, targets, batch_size=batch, shuffle=False, verbose=0).history
        evaluated = model.evaluate(x, targets, batch_size=batch, verbose=0, return_dict=True)
        for name in ("loss", "reg_loss", "cls_loss"):
            assert logged[name][0] == pytest.approx(expected[name], rel=1e-5), name
            assert evaluated[name] == pytest.approx(expected[name], rel=1e-5), name


def test_weight_regularizer_counted_once_per_update(replicas):
    x, y, _ = regression_data(45)

    def build():
        inputs = keras.Input((4,))
        return inputs, mlp(inputs, keras.regularizers.L2(0.3))

    reference, model = twins(replicas, build, sgd_mse, gradient_accumulation_steps=3)
    assert_matches_big_batch(reference, model, x, y, 10, 3)


def test_embedding_sparse_gradients(replicas):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 20, size=(37, 3))
    y = rng.normal(size=(37, 1)).astype("float32")

    def build():
        inputs = keras.Input((3,), dtype="int32")
        embedded = keras.layers.Embedding(20, 4)(inputs)
        flat = keras.layers.Flatten()(embedded)
        return inputs, keras.layers.Dense(1)(flat)

    reference, model = twins(replicas, build, sgd_mse, gradient_accumulation_steps=2)
    assert_matches_big_batch(reference, model, x, y, 8, 2)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_other_loss_reductions(replicas, reduction):
    x, y, w = regression_data(45)
    reference, model = twins(replicas, simple, sgd_mse_reduced(reduction), gradient_accumulation_steps=2)
    assert_matches_big_batch(reference, model, x, y, 10, 2, sample_weight=w)


def test_dataset_of_unknown_length_applies_partial_group_at_epoch_end(replicas):
    x, y, _ = regression_data(50)
    reference, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=3)
    reference.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(8)
    )
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    model.fit(dataset, epochs=2, verbose=0)
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    assert int(model.optimizer.iterations.numpy()) == 2 * 3


@pytest.mark.parametrize("execution", [3, 4])
@pytest.mark.parametrize("steps", [1, 2])
def test_steps_per_execution_matches_one_big_batch(replicas, execution, steps):
    # 75 samples in micro-batches of 8: 10 micro-batches, the last of 3
    # samples (split 2/1 on two replicas); the last execution is partial.
    x, y, w = regression_data(75)

    def compile_kwargs():
        return dict(sgd_mse(), steps_per_execution=execution)

    reference, model = twins(replicas, simple, compile_kwargs, gradient_accumulation_steps=steps)
    assert_matches_big_batch(reference, model, x, y, 8, steps, sample_weight=w)
    assert int(model.optimizer.iterations.numpy()) == 2 * -(-10 // steps)


def test_steps_per_epoch_not_a_multiple_of_steps_per_execution(replicas):
    # Keras runs whole executions: steps_per_epoch=5 at 3 steps per execution
    # runs 6 micro-batches an epoch, in groups of 2. Ending a group at step 5
    # split the third group: 4 updates an epoch instead of 3, 0.18 off with Adam.
    x, y, _ = regression_data(48)

    def adam(**options):
        return lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss="mse", **options)

    reference, model = twins(replicas, simple, adam(steps_per_execution=3), gradient_accumulation_steps=2)
    repeated = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    model.fit(repeated, epochs=3, steps_per_epoch=5, shuffle=False, verbose=0)
    # Stock on one device, one batch per group: 3 epochs of 6 micro-batches.
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 9
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE


def test_steps_per_execution_on_a_dataset_of_unknown_length(replicas):
    x, y, _ = regression_data(75)

    def compile_kwargs():
        return dict(sgd_mse(), steps_per_execution=4)

    reference, model = twins(replicas, simple, compile_kwargs, gradient_accumulation_steps=2)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.fit(_unknown_length(x, y, 8), epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE


def test_steps_per_execution_logs_as_one_step_at_a_time(replicas):
    x, y, w = regression_data(75)
    x_val, y_val, _ = regression_data(20, seed=1)
    histories, weights = [], []
    for execution in (1, 4):

        def compile_kwargs(execution=execution):
            return dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", steps_per_execution=execution)

        _, model = twins(replicas, simple, compile_kwargs, gradient_accumulation_steps=3, global_clipnorm=0.5)
        history = model.fit(
            x, y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(x_val, y_val)
        ).history
        histories.append(history)
        weights.append(model.get_weights())
    assert sorted(histories[1]) == sorted(histories[0])
    for name, values in histories[0].items():
        assert histories[1][name] == pytest.approx(values, rel=1e-6), name
    assert relative_error(*weights) < 1e-6


def test_logged_loss_is_exact_sample_weighted_mean():
    x, y, w = regression_data(33)

    def frozen():
        return dict(optimizer=keras.optimizers.SGD(0.0), loss="mse")

    reference, model = twins(2, simple, frozen)
    history = model.fit(x, y, sample_weight=w, batch_size=16, epochs=1, shuffle=False, verbose=0)
    expected = reference.evaluate(x, y, sample_weight=w, batch_size=33, verbose=0)
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-6)


def _weight_regularized():
    inputs = keras.Input((4,))
    return inputs, mlp(inputs, keras.regularizers.L2(0.5))


@pytest.mark.parametrize("steps,jit_compile", [(1, False), (2, False), (2, True)])
def test_logged_loss_has_the_penalty_of_the_weights_the_batch_ran_with(replicas, steps, jit_compile):
    # Stock logs each batch's loss with the weight penalty before its update;
    # read after it, the penalty was 5% off at this learning rate.
    x, y, _ = regression_data(40)

    def compiled():
        return dict(sgd_mse(), jit_compile=jit_compile)

    reference, model = twins(replicas, _weight_regularized, compiled, gradient_accumulation_steps=steps)
    expected = reference.fit(x, y, batch_size=8 * steps, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=1e-5)
    # train_on_batch returns the loss at the weights before its update.
    before = model.evaluate(x[:8], y[:8], verbose=0, return_dict=True)["loss"]
    logged = model.train_on_batch(x[:8], y[:8], return_dict=True)["loss"]
    assert logged == pytest.approx(before, rel=1e-5)


class _Interrupt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise KeyboardInterrupt


def leave_half_a_group(model, x, y, how):
    """Leaves the first micro-batch of 8 samples pending (accumulation 2)."""
    if how == "train_on_batch":
        model.train_on_batch(x[:8], y[:8])
        return
    with pytest.raises(KeyboardInterrupt):
        # A fit() stopped after its first micro-batch.
        model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0, callbacks=[_Interrupt()])


@pytest.mark.parametrize("how", ["train_on_batch", "interrupted fit"])
def test_a_pending_group_is_applied_when_fit_begins(replicas, how):
    # It was dropped: 0.35 from applying it, and no word of it.
    x, y, _ = regression_data(40)
    reference, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=2)
    leave_half_a_group(model, x, y, how)
    model.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference.train_on_batch(x[:8], y[:8])
    reference.fit(x[8:], y[8:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE


def test_a_group_pending_from_train_on_batch_is_applied_when_compile_is_called_again(replicas):
    x, y, _ = regression_data(8)
    reference, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=2)
    model.train_on_batch(x, y)  # half a group
    with strategy_for(replicas).scope():
        model.compile(**sgd_mse())
    reference.train_on_batch(x, y)
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_each_on_batch_call_counts_every_sample_once(replicas, reduction):
    # Keras gave every replica the whole batch: on 2 replicas a sum loss, its
    # update and samples_per_update were doubled, and predict_on_batch()
    # returned each row twice (14 rows for 7).
    x, y, weights = regression_data(7)
    reference, model = twins(replicas, simple, sgd_mse_reduced(reduction, metrics=["mae"]))
    # [loss, mae]: each over the 7 samples, not a mean of the shares' values.
    # (Keras 3.10 returns 0-d arrays where 3.15 returns floats.)
    tested = model.test_on_batch(x, y, weights)
    assert [float(v) for v in tested] == pytest.approx([float(v) for v in reference.test_on_batch(x, y, weights)], rel=1e-6)
    logs = model.train_on_batch(x, y, weights, return_dict=True)
    expected = reference.train_on_batch(x, y, weights, return_dict=True)
    assert (float(logs["loss"]), float(logs["mae"])) == pytest.approx((float(expected["loss"]), float(expected["mae"])), rel=1e-6)
    assert logs["samples_per_update"] == 7
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    predicted = model.predict_on_batch(x)
    assert predicted.shape == (7, 1)
    np.testing.assert_allclose(predicted, reference.predict_on_batch(x), rtol=1e-5, atol=1e-6)
    # One sample: the second replica's share is empty.
    logs = model.train_on_batch(x[:1], y[:1], return_dict=True)
    expected = reference.train_on_batch(x[:1], y[:1], return_dict=True)
    assert (float(logs["loss"]), float(logs["mae"])) == pytest.approx((float(expected["loss"]), float(expected["mae"])), rel=1e-6)
    assert logs["samples_per_update"] == 1
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    assert model.predict_on_batch(x[:1]).shape == (1, 1)


def test_a_replicas_share_of_one_batch_is_its_rows_dense_sparse_or_ragged():
    from keras_safe_dist.backend.tensorflow import _replica_shares

    dense = np.arange(12.0, dtype="float32").reshape(4, 3)
    share = _replica_shares._slice(tf.sparse.from_dense(dense), 1, 3)
    np.testing.assert_array_equal(tf.sparse.to_dense(share).numpy(), dense[1:3])
    ragged = tf.ragged.constant([[1.0], [2.0, 3.0], [], [4.0]])
    assert _replica_shares._slice(ragged, 1, 3).to_list() == [[2.0, 3.0], []]


def test_train_on_batch_groups_weigh_every_sample_once(replicas):
    # With accumulation 2, two train_on_batch() calls of 8 samples are one update of 16.
    x, y, _ = regression_data(16)
    reference, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=2)
    model.train_on_batch(x[:8], y[:8])
    logs = model.train_on_batch(x[8:], y[8:], return_dict=True)
    reference.train_on_batch(x, y)
    assert logs["samples_per_update"] == 16
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE


def test_a_batch_whose_arrays_disagree_on_the_samples_is_refused_on_several_replicas():
    x, y, _ = regression_data(8)
    _, model = twins(2, simple, sgd_mse)
    with pytest.raises(ValueError, match=r"its arrays hold different numbers of samples \(7, 8\)"):
        model.train_on_batch(x, y[:7])


def test_a_pending_group_is_named_when_saved_and_dropped_when_weights_are_loaded(replicas, tmp_path):
    # The file cannot hold a pending group; loaded weights then had a stale
    # micro-batch applied to them when fit() began (0.65 apart, one update more).
    x, y, _ = regression_data(24)
    reference, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=2)
    model.train_on_batch(x[:8], y[:8])  # half a group
    path = str(tmp_path / "model.weights.h5")
    with pytest.warns(UserWarning, match=r"save_weights\(\): 1 micro-batch\(es\) of a gradient accumulation group of 2 are pending"):
        model.save_weights(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.save(str(tmp_path / "model.keras"))  # said once per model
    with pytest.warns(UserWarning, match=r"load_weights\(\) dropped 1 micro-batch\(es\) of a pending"):
        model.load_weights(path)
    model.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference.load_weights(path)
    reference.fit(x[8:], y[8:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.load_weights(path)  # nothing pending: no word


def test_first_batch_split_unevenly_trains():
    x, y, _ = regression_data(63)
    reference, model = twins(2, simple, sgd_mse)
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE


def _activity_regularized():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(
        3, activity_regularizer=keras.regularizers.L2(0.5), name="penalized"
    )(inputs)
    return inputs, keras.layers.Dense(1)(hidden)


def test_activity_regularizer_matches_one_device(replicas):
    # Each Keras release's own convention (a penalty divided by the batch
    # size from keras 3.14, summed over the batch before), with an uneven
    # last batch.
    x, y, _ = regression_data(45)
    reference, model = twins(replicas, _activity_regularized, sgd_mse)
    assert_matches_big_batch(reference, model, x, y, 10, 1)
    expected = reference.evaluate(x, y, batch_size=10, verbose=0)
    assert model.evaluate(x, y, batch_size=10, verbose=0) == pytest.approx(expected, rel=1e-5)
    frozen, logged = twins(replicas, _activity_regularized, lambda: dict(optimizer=keras.optimizers.SGD(0.0), loss="mse"))
    logged_loss = logged.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"][0]
    assert logged_loss == pytest.approx(frozen.evaluate(x, y, batch_size=10, verbose=0), rel=1e-5)


def test_activity_regularizer_with_accumulation_matches_one_big_batch(replicas):
    x, y, _ = regression_data(45)
    reference, model = twins(replicas, _activity_regularized, sgd_mse, gradient_accumulation_steps=3)
    if _compat.activity_penalty_per_sample():
        # keras >= 3.14: a per-sample mean, weighted by each micro-batch's
        # share of the samples.
        assert_matches_big_batch(reference, model, x, y, 10, 3)
        return
    # keras < 3.14 sums the penalty over the batch: not expressible with one
    # division per update, refused rather than approximated.
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 on keras .*'penalized'"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)


def test_activity_regularizer_with_xla_on_two_replicas_matches_one_device():
    x, y, _ = regression_data(45)

    def compile_kwargs():
        return dict(sgd_mse(), jit_compile=True)

    reference, model = twins(2, _activity_regularized, compile_kwargs)
    if _compat.activity_penalty_per_sample():
        assert_matches_big_batch(reference, model, x, y, 10, 1)
        return
    with pytest.raises(ValueError, match=r"jit_compile=True on keras .*'penalized'"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)


def _unknown_length(x, y, batch):
    # A filter hides the dataset's length from Keras.
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).filter(lambda *_: True)


def test_validation_sees_the_weights_after_the_partial_group(replicas):
    x, y, _ = regression_data(88)
    x_val, y_val, _ = regression_data(20, seed=1)
    _, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=4)
    # 11 micro-batches: two groups of 4 and a partial group of 3 at the end.
    history = model.fit(
        _unknown_length(x, y, 8), epochs=1, verbose=0, validation_data=(x_val, y_val)
    ).history
    assert int(model.optimizer.iterations.numpy()) == 3
    assert history["samples_per_update"] == [24.0]
    expected = model.evaluate(x_val, y_val, verbose=0)
    assert history["val_loss"][0] == pytest.approx(expected, rel=1e-6)


def test_checkpoint_after_a_partial_group_holds_the_final_weights(replicas, tmp_path):
    x, y, _ = regression_data(88)
    _, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=4)
    path = str(tmp_path / "last.weights.h5")
    saver = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    model.fit(_unknown_length(x, y, 8), epochs=1, verbose=0, callbacks=[saver])
    saved = model.get_weights()
    model.load_weights(path)
    assert relative_error(saved, model.get_weights()) == 0.0


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight", "sum"])
@pytest.mark.parametrize("batch", [32, 5, 64])
def test_evaluate_equals_one_device_for_any_split(replicas, reduction, batch):
    x, y, w = regression_data(65)

    def compile_kwargs():
        return dict(
            optimizer="sgd",
            loss=keras.losses.MeanSquaredError(reduction=reduction),
            metrics=["mae"],
            weighted_metrics=["mse"],
        )

    def regularized():
        inputs = keras.Input((4,))
        return inputs, mlp(inputs, regularizer=keras.regularizers.L2(0.01))

    reference, model = twins(replicas, regularized, compile_kwargs)
    expected = reference.evaluate(x, y, sample_weight=w, batch_size=batch, verbose=0, return_dict=True)
    results = model.evaluate(x, y, sample_weight=w, batch_size=batch, verbose=0, return_dict=True)
    assert sorted(results) == sorted(expected)
    for name, value in expected.items():
        assert results[name] == pytest.approx(value, rel=1e-6), name


@pytest.mark.parametrize("samples", [80, 75])
def test_unknown_length_with_groups_that_divide_the_batches_is_exact(replicas, samples):
    # 10 micro-batches, groups of 2: Keras's extra call on the exhausted
    # dataset must not count as a micro-batch.
    x, y, _ = regression_data(samples)
    reference, model = twins(replicas, simple, sgd_mse, gradient_accumulation_steps=2)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.fit(_unknown_length(x, y, 8), epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    assert relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE


@pytest.mark.parametrize("steps", [1, 2])
def test_jit_compile_on_two_replicas_matches_one_device(steps):
    # 75 samples: the last micro-batch splits 2/1 across the replicas.
    x, y, w = regression_data(75)

    reference, model = twins(2, simple, sgd_mse, gradient_accumulation_steps=steps)
    with strategy_for(2).scope():
        model.compile(**sgd_mse(), jit_compile=True)
    assert model._xla_replicas is True
    reference.fit(x, y, sample_weight=w, batch_size=8 * steps, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    # XLA reassociates sums and approximates tanh.
    assert relative_error(reference.get_weights(), model.get_weights()) < 1e-4
    assert int(model.optimizer.iterations.numpy()) == 2 * -(-10 // steps)
    assert history["samples_per_update"][-1] == 75 - (-(-10 // steps) - 1) * 8 * steps


def test_jit_compile_on_two_replicas_writes_back_batch_normalization_state():
    x, y, _ = regression_data(64)

    def normalized():
        inputs = keras.Input((4,))
        hidden = keras.layers.BatchNormalization(momentum=0.5)(keras.layers.Dense(3)(inputs))
        return inputs, keras.layers.Dense(1)(hidden)

    models = []
    for jit in (False, True):
        _, model = twins(2, normalized, sgd_mse)
        with strategy_for(2).scope():
            model.compile(**sgd_mse(), jit_compile=jit)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    plain, compiled = models
    # The bias before BatchNormalization gets gradients of about 1e-8: absolute tolerance.
    for a, b in zip(plain.get_weights(), compiled.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    strategy = strategy_for(2)
    for a, b in zip(plain.non_trainable_variables, compiled.non_trainable_variables):
        for one, other in zip(strategy.experimental_local_results(a.value), strategy.experimental_local_results(b.value)):
            np.testing.assert_allclose(one.numpy(), other.numpy(), rtol=1e-4, atol=1e-6)


FAST_PATHS = {"plain": {}, "k3": {"steps_per_execution": 3}, "xla": {"jit_compile": True}}


@pytest.mark.parametrize("fast", list(FAST_PATHS))
def test_fast_paths_skip_a_nonfinite_batch_as_if_it_were_not_there(fast):
    # 64 samples in batches of 8; batch 4 (rows 32-39) holds an infinity. SGD
    # without momentum: skipping its update equals training without it.
    x, y, _ = regression_data(64)
    x[35, 1] = np.inf

    def compile_kwargs():
        return dict(sgd_mse(), **FAST_PATHS[fast])

    reference, model = twins(2, simple, sgd_mse)
    with strategy_for(2).scope():
        model.compile(**compile_kwargs())
    kept = np.r_[0:32, 40:64]
    reference.fit(x[kept], y[kept], batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert history["skipped_updates"] == [1.0, 2.0]  # counted over the fit
    assert int(model.optimizer.iterations.numpy()) == 2 * 7
    assert relative_error(reference.get_weights(), model.get_weights()) < 1e-4


@pytest.mark.parametrize("fast", list(FAST_PATHS))
def test_fast_paths_under_mixed_precision_match_one_device(fast):
    # A loss scale that no batch overflows: whether float16 overflows depends
    # on how many samples a sum spans, which differs between one device's
    # batch and a replica's share of a micro-batch.
    x, y, _ = regression_data(75)
    keras.config.set_dtype_policy("mixed_float16")

    def compile_kwargs(**fast_options):
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
        return dict(optimizer=optimizer, loss="mse", **fast_options)

    reference, model = twins(2, simple, compile_kwargs, gradient_accumulation_steps=2)
    with strategy_for(2).scope():
        model.compile(**compile_kwargs(**FAST_PATHS[fast]))
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 10
    assert history["skipped_updates"] == [0.0, 0.0]
    # float16 forward and backward passes.
    assert relative_error(reference.get_weights(), model.get_weights()) < 2e-3
