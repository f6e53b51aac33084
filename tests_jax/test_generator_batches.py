"""A generator that fills the same arrays again for each batch trains, evaluates and predicts on what it gave (JAX).

Stock Keras reads a generator's first two batches ahead and trains on them
later by reference, and on a CPU places batches without a copy: fed such a
generator, stock trains on other data than it gave. The reference is stock
Keras on one device, fed the same data as arrays.
"""

import keras
import numpy as np
import pytest

from keras_safe_dist import SafeDistributedModel

from conftest import regression_data

STEPS = 40
TOLERANCE = 1e-5


def _refilled(x, y=None):
    """Yields each batch of 8 in the same arrays, filled again (`(x,)` when `y` is None)."""
    x_buffer = np.empty((8, x.shape[1]), x.dtype)
    y_buffer = None if y is None else np.empty((8, y.shape[1]), y.dtype)
    for start in range(0, len(x), 8):
        x_buffer[:] = x[start : start + 8]
        if y is None:
            yield (x_buffer,)
            continue
        y_buffer[:] = y[start : start + 8]
        yield x_buffer, y_buffer


def _model(model_class, initial=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = model_class(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if initial is not None:
        model.set_weights(initial)
    return model


def _one_device(run):
    """`run()` with no distribution, whatever the test set."""
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        return run()
    finally:
        keras.distribution.set_distribution(distribution)


def _relative_error(expected, actual):
    return max(
        float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-2)) for e, a in zip(expected, actual)
    )


def test_fit_and_its_validation_train_on_the_batches_the_generator_gave(devices):
    x, y, _ = regression_data(STEPS * 8)
    x_val, y_val, _ = regression_data(10 * 8, seed=1)

    def stock_runs():
        reference = _model(keras.Model)
        initial = reference.get_weights()
        reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        stock = _model(keras.Model, initial)
        stock.fit(_refilled(x, y), steps_per_epoch=STEPS, epochs=1, shuffle=False, verbose=0)
        return reference, stock, initial

    reference, stock, initial = _one_device(stock_runs)
    model = _model(SafeDistributedModel, initial)
    history = model.fit(
        _refilled(x, y), steps_per_epoch=STEPS, epochs=1, shuffle=False, verbose=0,
        validation_data=_refilled(x_val, y_val), validation_steps=10,
    )

    assert _relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    # Stock trains its first step on the second batch (read ahead, then filled again).
    assert _relative_error(reference.get_weights(), stock.get_weights()) > TOLERANCE

    def val_loss():
        reference.set_weights(model.get_weights())
        return reference.evaluate(x_val, y_val, batch_size=8, verbose=0)

    np.testing.assert_allclose(history.history["val_loss"][0], _one_device(val_loss), rtol=1e-5)


def test_evaluate_and_predict_read_the_batches_the_generator_gave(devices):
    x, y, _ = regression_data(STEPS * 8)
    reference = _one_device(lambda: _model(keras.Model))
    model = _model(SafeDistributedModel, reference.get_weights())

    loss = model.evaluate(_refilled(x, y), steps=STEPS, verbose=0)
    predictions = model.predict(_refilled(x), steps=STEPS, verbose=0)

    expected_loss, expected_predictions = _one_device(lambda: (
        reference.evaluate(x, y, batch_size=8, verbose=0),
        reference.predict(x, batch_size=8, verbose=0),
    ))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    np.testing.assert_allclose(predictions, expected_predictions, rtol=1e-5, atol=1e-6)


def test_a_generator_of_arrays_instead_of_tuples_still_gets_keras_s_message():
    def arrays():
        while True:
            yield np.zeros((8, 4), "float32")

    with pytest.raises(ValueError, match="the generator must return a tuple"):
        _model(SafeDistributedModel).fit(arrays(), steps_per_epoch=2, shuffle=False, verbose=0)
