"""A replica whose share of a batch is empty contributes nothing, and nothing breaks."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_safe_dist import SafeDistributedModel

from conftest import mirrored_strategy
from conftest import relative_error

# 65 samples in batches of 32: the last batch has one sample, so on two
# replicas the second replica's share of it is empty.
SAMPLES, BATCH = 65, 32


def data(shape):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES,) + shape).astype("float32")
    y = rng.normal(size=(SAMPLES, 1)).astype("float32")
    return x, y


def conv1d(inputs):
    return keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Conv1D(4, 3)(inputs)))


def conv2d(inputs):
    return keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Conv2D(2, 3)(inputs)))


def pair(build, shape, **compile_kwargs):
    """A stock model on one device and a SafeDistributedModel on two replicas."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    stock = keras.Model(inputs, build(inputs))
    stock.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", **compile_kwargs)
    with mirrored_strategy().scope():
        inputs = keras.Input(shape)
        model = SafeDistributedModel(inputs, build(inputs), log_update_stats=True)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", **compile_kwargs)
        model.set_weights(stock.get_weights())
    return stock, model


@pytest.mark.parametrize("build,shape", [(conv1d, (8, 3)), (conv2d, (5, 5, 2))], ids=["conv1d", "conv2d"])
def test_convolutions_train_evaluate_and_predict_as_one_device(build, shape):
    x, y = data(shape)
    stock, model = pair(build, shape)
    stock.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    assert history["skipped_updates"] == [0.0, 0.0]
    assert relative_error(stock.get_weights(), model.get_weights()) < 1e-5
    assert model.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        stock.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-6
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=BATCH, verbose=0), stock.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_run_eagerly_trains_as_one_device():
    x, y = data((4,))
    stock, model = pair(lambda inputs: keras.layers.Dense(1)(inputs), (4,), run_eagerly=True)
    stock.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    assert history["skipped_updates"] == [0.0, 0.0]
    assert int(model.optimizer.iterations.numpy()) == 6
    assert relative_error(stock.get_weights(), model.get_weights()) < 1e-5


def batch_normalized(inputs):
    hidden = keras.layers.BatchNormalization(momentum=0.5)(keras.layers.Dense(3)(inputs))
    return keras.layers.Dense(1)(hidden)


def test_batch_normalization_keeps_finite_statistics_and_every_update():
    x, y = data((4,))
    _, model = pair(batch_normalized, (4,))
    norm = model.layers[2]
    before = [np.stack(tf.distribute.get_strategy().experimental_local_results(v.value)) for v in norm.non_trainable_variables]
    history = model.fit(x[64:], y[64:], batch_size=BATCH, epochs=1, verbose=0).history
    # One sample: replica 0 trains on it, replica 1's share is empty.
    assert history["skipped_updates"] == [0.0]
    assert int(model.optimizer.iterations.numpy()) == 1
    for variable, old in zip(norm.non_trainable_variables, before):
        first, second = mirrored_strategy().experimental_local_results(variable.value)
        assert np.isfinite(first.numpy()).all()
        # The empty share left its replica's moving statistics as they were.
        np.testing.assert_array_equal(second.numpy(), old[0])
        assert not np.array_equal(first.numpy(), old[0])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, validation_data=(x, y)).history
    assert history["skipped_updates"] == [0.0, 0.0]
    assert np.isfinite(history["val_loss"]).all()
    assert np.isfinite(model.predict(x, batch_size=BATCH, verbose=0)).all()


def test_sparse_input_that_would_leave_a_share_empty_is_refused_with_the_fix():
    x, y = data((4,))
    with mirrored_strategy().scope():
        inputs = keras.Input((4,), sparse=True)
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    sparse = tf.sparse.from_dense(x)
    with pytest.raises(ValueError, match=(
        r"The last batch of this fit\(\) holds 1 sample\(s\) for 2 replicas.*"
        r"Received: 65 samples, batch_size=32.*first 64 samples"
    )):
        model.fit(sparse, y, batch_size=BATCH, verbose=0)
    first = tf.sparse.slice(sparse, [0, 0], [64, 4])
    history = model.fit(first, y[:64], batch_size=BATCH, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"]).all()


def synchronized_convnet(inputs):
    hidden = keras.layers.Conv2D(4, 3)(inputs)
    hidden = keras.layers.BatchNormalization(synchronized=True, name="bn")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(keras.layers.Activation("relu")(hidden))
    return keras.layers.Dense(1)(hidden)


def test_synchronized_batch_normalization_leaves_an_empty_share_out():
    # On one device synchronized=True is plain BatchNormalization: the
    # reference. The last batch holds one sample; the empty share's padding
    # row must not enter the statistics summed across replicas.
    x, y = data((5, 5, 2))
    stock, model = pair(synchronized_convnet, (5, 5, 2))
    fit = dict(batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    expected = stock.fit(x, y, **fit).history["loss"]
    logged = model.fit(x, y, **fit).history["loss"]
    assert relative_error(stock.get_weights(), model.get_weights()) < 1e-5
    np.testing.assert_allclose(logged, expected, rtol=1e-5)
    # Both replicas hold the same moving statistics.
    for variable in model.get_layer("bn").non_trainable_variables:
        copies = mirrored_strategy().experimental_local_results(variable.value)
        np.testing.assert_allclose(copies[0].numpy(), copies[1].numpy(), rtol=1e-6)
