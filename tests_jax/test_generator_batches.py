"""A generator or a `PyDataset` that fills the same arrays again for each batch trains, evaluates and predicts on what it gave (JAX).

Stock Keras reads a generator's first two batches ahead and trains on them
later by reference, and on a CPU places batches under `DataParallel` without
a copy: fed such data, stock trains on other batches than it gave. The
reference is stock Keras on one device, fed the same data as arrays.
"""

import jax
import keras
import numpy as np
import pytest
from refilling import RefilledDataset
from refilling import dense_model
from refilling import refilled

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.core import _generators

from conftest import one_device
from conftest import regression_data

STEPS = 40
TOLERANCE = 1e-5


def _relative_error(expected, actual):
    return max(
        float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-2)) for e, a in zip(expected, actual)
    )


@pytest.mark.parametrize("data", [refilled, RefilledDataset], ids=["generator", "PyDataset"])
def test_fit_and_its_validation_train_on_the_batches_the_data_gave(devices, data):
    x, y, _ = regression_data(STEPS * 8)
    x_val, y_val, _ = regression_data(10 * 8, seed=1)

    def reference_run():
        reference = dense_model(keras.Model)
        initial = reference.get_weights()
        reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return reference, initial

    reference, initial = one_device(reference_run)
    model = dense_model(SafeDistributedModel, initial)
    history = model.fit(
        data(x, y), steps_per_epoch=STEPS, epochs=1, shuffle=False, verbose=0,
        validation_data=data(x_val, y_val), validation_steps=10,
    )

    assert _relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    if data is refilled:
        # Stock trains a generator's first step on the second batch (read
        # ahead, then filled again).
        def stock_run():
            stock = dense_model(keras.Model, initial)
            stock.fit(data(x, y), steps_per_epoch=STEPS, epochs=1, shuffle=False, verbose=0)
            return stock.get_weights()

        assert _relative_error(reference.get_weights(), one_device(stock_run)) > TOLERANCE
    # A PyDataset: stock under DataParallel places the aligned shards without
    # a copy, and a step that runs after the next `__getitem__` reads them
    # filled again: 0.1 to 5 (relative) in 3 runs of 3 in a script, exact in
    # some runs of this test (a race; one device: exact), so not asserted.
    # The copy itself is checked below.

    def val_loss():
        reference.set_weights(model.get_weights())
        return reference.evaluate(x_val, y_val, batch_size=8, verbose=0)

    np.testing.assert_allclose(history.history["val_loss"][0], one_device(val_loss), rtol=1e-5)


@pytest.mark.parametrize("data", [refilled, RefilledDataset], ids=["generator", "PyDataset"])
def test_evaluate_and_predict_read_the_batches_the_data_gave(devices, data):
    x, y, _ = regression_data(STEPS * 8)
    reference = one_device(lambda: dense_model(keras.Model))
    model = dense_model(SafeDistributedModel, reference.get_weights())

    loss = model.evaluate(data(x, y), steps=STEPS, verbose=0)
    predictions = model.predict(data(x), steps=STEPS, verbose=0)

    expected_loss, expected_predictions = one_device(lambda: (
        reference.evaluate(x, y, batch_size=8, verbose=0),
        reference.predict(x, batch_size=8, verbose=0),
    ))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    np.testing.assert_allclose(predictions, expected_predictions, rtol=1e-5, atol=1e-6)


def test_each_batch_is_a_copy_and_a_py_dataset_keeps_its_settings():
    x, y, _ = regression_data(32)
    dataset = RefilledDataset(x, y, workers=2)
    generator = refilled(x, y)

    copied = _generators.fresh_batches(dataset)
    batches = list(_generators.fresh_batches(generator))

    assert (copied.workers, copied.use_multiprocessing, copied.num_batches) == (2, False, 4)
    first = copied[0][0]
    dataset[1]  # fills the same arrays again
    np.testing.assert_array_equal(first, x[:8])
    # Every batch of a generator, not only the 2 Keras reads ahead.
    for index, batch in enumerate(batches):
        np.testing.assert_array_equal(batch[0], x[index * 8 : (index + 1) * 8])


@pytest.mark.parametrize("data", [refilled, RefilledDataset], ids=["generator", "PyDataset"])
def test_fed_as_on_an_accelerator_the_data_trains_on_what_it_gave(monkeypatch, data):
    # On an accelerator Keras places each batch one step ahead, and the data
    # fills its arrays again for the next one while the transfer may still
    # read them. On a CPU device_put aliases an aligned array, so here the
    # placed batch holds the next one's data every time.
    x, y, _ = regression_data(STEPS * 8)
    reference = dense_model(keras.Model)
    initial = reference.get_weights()
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # Keras's test for one batch ahead
    stock = dense_model(keras.Model, initial)
    stock.fit(data(x, y), steps_per_epoch=STEPS, epochs=1, shuffle=False, verbose=0)
    model = dense_model(SafeDistributedModel, initial)
    model.fit(data(x, y), steps_per_epoch=STEPS, epochs=1, shuffle=False, verbose=0)

    assert _relative_error(reference.get_weights(), model.get_weights()) < TOLERANCE
    assert _relative_error(reference.get_weights(), stock.get_weights()) > TOLERANCE


def test_a_generator_of_arrays_instead_of_tuples_still_gets_keras_s_message():
    def arrays():
        while True:
            yield np.zeros((8, 4), "float32")

    with pytest.raises(ValueError, match="the generator must return a tuple"):
        dense_model(SafeDistributedModel).fit(arrays(), steps_per_epoch=2, shuffle=False, verbose=0)
