"""Host reads and eager operations between steps on TensorFlow: stock Keras's count is the bar.

Keras's TensorFlow trainer waits for each step itself: it asks the step's
optional outputs `has_value()` (one host read per step) and turns the logs
into Python numbers before any batch hook (`pythonify_logs`). What `SafeDistributedModel` and `NaNOnsetDetector` add to the logs
(the update statistics, the detector's flags) is read there, from the same
step's results, without another wait. These tests count, over `fit()`s of 24
and 48 steps, the host reads made anywhere else and the eager operations and
function calls the host launches; the difference between the two is the cost
of 24 steps.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import execute
from tensorflow.python.framework import ops

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.callbacks import Dashboard
from keras_safe_dist.callbacks import NaNOnsetDetector

from conftest import strategy_for

BATCH = 8


class _Counts:
    def __init__(self):
        self.launches = 0
        self.reads = 0


def _outside_log_conversion():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "pythonify_logs":
            return False
        frame = frame.f_back
    return True


def _counting(counts, monkeypatch):
    fast_path = pywrap_tfe.TFE_Py_FastPathExecute
    quick = execute.quick_execute
    numpy = ops._EagerTensorBase._numpy

    def fast_path_counted(*args, **kwargs):
        counts.launches += 1
        return fast_path(*args, **kwargs)

    def quick_counted(*args, **kwargs):
        counts.launches += 1
        return quick(*args, **kwargs)

    def numpy_counted(self):
        if _outside_log_conversion():
            counts.reads += 1
        return numpy(self)

    monkeypatch.setattr(pywrap_tfe, "TFE_Py_FastPathExecute", fast_path_counted)
    monkeypatch.setattr(execute, "quick_execute", quick_counted)
    monkeypatch.setattr(ops._EagerTensorBase, "_numpy", numpy_counted)


def _count(model, steps, callbacks):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    fit = lambda: model.fit(  # noqa: E731
        x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=callbacks()
    )
    fit()  # traces
    counts = _Counts()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _counting(counts, monkeypatch)
        fit()
    return counts


def _per_24_steps(build, callbacks, replicas):
    """`(launches, reads outside Keras's log conversion)` that 24 more steps add to a fit()."""
    with strategy_for(replicas).scope():
        model = build()
    short = _count(model, 24, callbacks)
    long = _count(model, 48, callbacks)
    return long.launches - short.launches, long.reads - short.reads


def _mlp(cls):
    def build():
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = cls(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="adam", loss="mse")
        return model

    return build


@pytest.fixture(scope="module", params=[1, 2], ids=["1replica", "2replicas"])
def stock(request):
    return request.param, _per_24_steps(_mlp(keras.Model), lambda: None, request.param)


def test_stock_reads_once_per_step_besides_its_logs(stock):
    # Keras's own `has_value()` on each step's outputs.
    _, (launches, reads) = stock
    assert reads == 24
    # One call of the step function per step; the data iterator's own
    # operations, if any, are stock's too.
    assert launches >= 24


def test_the_safe_step_adds_no_launch_or_host_read_per_step(stock):
    replicas, counted = stock
    assert _per_24_steps(_mlp(SafeDistributedModel), lambda: None, replicas) == counted


def test_the_dashboard_adds_no_launch_or_host_read_per_step(stock, tmp_path):
    replicas, counted = stock
    callbacks = lambda: [Dashboard(str(tmp_path))]  # noqa: E731
    assert _per_24_steps(_mlp(SafeDistributedModel), callbacks, replicas) == counted


@pytest.mark.parametrize("action", ["stop", "continue"])
def test_the_nan_detector_adds_no_launch_or_host_read_per_step(stock, action):
    # Its flags come back in the step's logs, read with them.
    replicas, counted = stock
    callbacks = lambda: [NaNOnsetDetector(action=action)]  # noqa: E731
    assert _per_24_steps(_mlp(SafeDistributedModel), callbacks, replicas) == counted


def test_restore_copies_the_weights_inside_the_step(stock):
    replicas, counted = stock
    callbacks = lambda: [NaNOnsetDetector(action="restore")]  # noqa: E731
    assert _per_24_steps(_mlp(SafeDistributedModel), callbacks, replicas) == counted


def test_tensorflow_is_the_backend():
    assert keras.backend.backend() == "tensorflow" and tf.executing_eagerly()
