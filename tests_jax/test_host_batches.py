"""NaNOnsetDetector's kept batches on JAX: the host arrays the data gave, not the placed ones.

On an accelerator (and under a distribution anywhere) Keras's JAX epoch
iterator places each batch on the devices. The detector keeps the host
arrays instead (`_host_batches`), where the data makes new ones for each
batch; a generator's batches are kept as Keras placed them, or copied.
`accelerator_feeding` makes Keras feed a CPU as it feeds an accelerator:
each batch placed on the device, one step ahead.
"""

import jax
import keras
import numpy as np
import pytest
from keras import ops

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.backend.jax import _host_batches
from keras_safe_dist.callbacks import NaNOnsetDetector

from conftest import KeptAtEpochEnd
from conftest import regression_data


@pytest.fixture(params=["cpu", "accelerator"])
def feeding(request, monkeypatch):
    """How Keras's JAX epoch iterator feeds the step: as on a CPU, or as on an accelerator."""
    if request.param == "accelerator":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    return request.param


class Root(keras.layers.Layer):
    """sqrt(x): NaN for a negative input."""

    def call(self, x):
        return ops.sqrt(x)


def _model(root=False):
    inputs = keras.Input((4,))
    hidden = Root(name="root")(inputs) if root else inputs
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _placed(batch):
    return isinstance(keras.tree.flatten(batch)[0], jax.Array)


def test_the_detector_keeps_the_host_arrays_the_data_gave(devices, feeding):
    x, y, _ = regression_data(40 * 8)
    seen = KeptAtEpochEnd()
    _model().fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                 callbacks=[NaNOnsetDetector(check_every=5), seen])
    (kept,) = seen.kept
    assert [step for step, _ in kept] == list(range(40 - 11, 40))
    for step, batch in kept:
        assert not _placed(batch), (step, type(batch[0]))
        np.testing.assert_array_equal(batch[0], x[8 * step : 8 * step + 8])
        np.testing.assert_array_equal(batch[1], y[8 * step : 8 * step + 8])


def test_an_onset_in_a_kept_host_batch_is_named_by_its_layer_batch_and_rows(devices, feeding):
    x, y, _ = regression_data(40 * 8)
    x = np.abs(x)
    x[17 * 8 + 3, 1] = -1.0  # batch 17, row 3: sqrt of a negative number
    detector = NaNOnsetDetector(check_every=5)
    _model(root=True).fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                          callbacks=[detector])
    report = detector.report
    assert (report["batch"], report["kind"], report["layer"], report["rows"]) == (
        17, "activations", "root", [3]
    )


def _refilled(x, y):
    """A generator that fills the same two arrays again for each batch of 8."""
    x_buffer, y_buffer = np.empty((8, x.shape[1]), x.dtype), np.empty((8, 1), y.dtype)
    while True:
        for start in range(0, len(x), 8):
            x_buffer[:] = x[start : start + 8]
            y_buffer[:] = y[start : start + 8]
            yield x_buffer, y_buffer


def test_a_generator_that_refills_its_buffers_is_kept_as_each_step_got_it(devices, feeding):
    # A reference to the generator's buffer (or, on a CPU, to a placed batch
    # that shares it or is copied from it later) would hold a later batch.
    x, y, _ = regression_data(40 * 8)
    seen = KeptAtEpochEnd()
    _model().fit(_refilled(x, y), steps_per_epoch=40, epochs=1, verbose=0, shuffle=False,
                 callbacks=[NaNOnsetDetector(check_every=5), seen])
    (kept,) = seen.kept
    assert [step for step, _ in kept] == list(range(40 - 11, 40))
    for step, batch in kept:
        np.testing.assert_array_equal(np.asarray(batch[0]), x[8 * step : 8 * step + 8])
        np.testing.assert_array_equal(np.asarray(batch[1]), y[8 * step : 8 * step + 8])


def test_each_placed_batch_is_told_with_the_host_batch_it_came_from(devices, feeding):
    # Two steps per execution, 3 steps an epoch over 5 batches: Keras reads
    # one batch ahead on an accelerator, and keeps its iterator across epochs.
    x, y, _ = regression_data(5 * 8)
    iterator = _host_batches.HostBatchesEpochIterator(
        x=x, y=y, batch_size=8, steps_per_epoch=3, shuffle=False, steps_per_execution=2
    )
    told = []
    for _ in range(2):
        with iterator.catch_stop_iteration():
            for *_, batches in iterator:  # (begin, end, it); Keras 3.10: (step, it)
                for _ in range(2):
                    try:
                        placed = next(batches)
                    except StopIteration:
                        break
                    host = batches.host_batch
                    assert not _placed(host)
                    np.testing.assert_array_equal(host[0], np.asarray(placed[0]))
                    told.append(host[0][0, 0])
        iterator.reset()
    assert told, "no batch was told"
    assert all(first in x[::8, 0] for first in told)
    expected_placed = feeding == "accelerator" or devices == 2
    assert _placed(placed) == expected_placed


def test_the_train_step_still_gets_the_batches_keras_placed(devices, feeding):
    # The detector keeps the host arrays; Keras's step gets what Keras placed.
    x, y, _ = regression_data(6 * 8)
    model = _model()
    seen = []
    step = model.train_step

    def train_step(state, data):
        seen.append(_placed(data))
        return step(state, data)

    model.train_step = train_step
    model.run_eagerly = True
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[NaNOnsetDetector(check_every=5)])
    assert seen == [feeding == "accelerator" or devices == 2] * 6
