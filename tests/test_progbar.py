"""The progress bar shows the loss and metrics; the update statistics reach the other callbacks."""

import re

import keras
import numpy as np

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.callbacks import Dashboard
from keras_safe_dist.update._progbar import ProgbarWithoutStatistics
from keras_safe_dist.update.statistics import LOG_NAMES

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _fit(tmp_path, capsys, **fit_kwargs):
    keras.utils.set_random_seed(0)
    x = np.random.normal(size=(96, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    inputs = keras.Input((4,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    history = model.fit(
        x, y, batch_size=32, epochs=2, callbacks=[Dashboard(str(tmp_path))], **fit_kwargs
    )
    lines = re.split(r"[\r\n]", _ANSI.sub("", capsys.readouterr().out))
    return history, [line.rstrip("\b").rstrip() for line in lines if line.strip("\b ")]


def test_progress_line_shows_loss_and_metrics_only_within_100_columns(tmp_path, capsys):
    history, lines = _fit(tmp_path, capsys)
    last = lines[-1]
    assert re.fullmatch(r"3/3 ━{20} \d+s \d+ms/step - loss: \d\.\d{4} - mae: \d\.\d{4}", last), last
    assert max(len(line) for line in lines) <= 100
    # History (and so Keras's TensorBoard, every callback) still has every statistic.
    assert set(LOG_NAMES) <= set(history.history)


def test_verbose_2_prints_the_same_values(tmp_path, capsys):
    _, lines = _fit(tmp_path, capsys, verbose=2)
    assert re.fullmatch(r"3/3 - \d+s - \d+ms/step - loss: \d\.\d{4} - mae: \d\.\d{4}", lines[-1])


def test_a_users_own_progbar_is_left_as_it_is():
    from keras_safe_dist.update import _progbar

    own = keras.callbacks.ProgbarLogger()
    assert _progbar.for_fit([own], stats_requested=True) == []
    assert _progbar.for_fit(None, stats_requested=False) == []
    [added] = _progbar.for_fit(None, stats_requested=True)
    assert isinstance(added, ProgbarWithoutStatistics) and added.async_safe is True
