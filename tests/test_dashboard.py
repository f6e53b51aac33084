"""The Dashboard charts each epoch's spread over its updates, not only its last update."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist.report import format_text
from keras_safe_dist.report import read_log_dir

from conftest import regression_data
from conftest import strategy_for


def scalars(events, tag):
    return [float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]


def test_partial_last_group_does_not_hide_the_typical_update(tmp_path):
    # 5 groups of 3 x 32 = 96 samples, then one of 20: samples_per_update
    # reads 20 (the last update); the spread shows the 96-sample updates.
    x, y, _ = regression_data(5 * 96 + 20)
    steps, batch = 3, 32
    with strategy_for(2).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=steps)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    history = model.fit(
        x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[callbacks.Dashboard(tmp_path)]
    ).history
    sizes = [len(x[i : i + steps * batch]) for i in range(0, len(x), steps * batch)]
    events = event_accumulator.EventAccumulator(str(tmp_path / "safe_distributed"), size_guidance={"tensors": 0})
    events.Reload()
    assert scalars(events, "safe_distributed/samples_per_update") == [sizes[-1]] * 2 == [20.0] * 2
    assert scalars(events, "safe_distributed/samples_per_update_min") == [min(sizes)] * 2
    assert scalars(events, "safe_distributed/samples_per_update_max") == [max(sizes)] * 2 == [96.0] * 2
    assert scalars(events, "safe_distributed/samples_per_update_mean") == pytest.approx([np.mean(sizes)] * 2)
    for part in ("min", "mean", "max"):
        assert scalars(events, f"safe_distributed/grad_norm_{part}") == pytest.approx(history[f"grad_norm_{part}"])
    norms = np.array([history[f"grad_norm_{part}"] for part in ("min", "mean", "max")])
    assert (norms[0] <= norms[1]).all() and (norms[1] <= norms[2]).all() and (norms[0] < norms[2]).all()
    # One chart per statistic shows the last update and the spread together.
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(tf.make_ndarray(config.tensor_proto).item())
    chart = {c.title: c for c in layout.category[0].chart}["samples per update"]
    assert list(chart.multiline.tag) == [
        "^safe_distributed/samples_per_update(_min|_mean|_max)?$",
        "^epoch_samples_per_update(_min|_mean|_max)?$",
    ]
    # The report reads them back.
    report = read_log_dir(str(tmp_path))
    (run,) = report.runs
    assert run.values["samples_per_update_mean"] == pytest.approx([np.mean(sizes)] * 2)
    text = format_text(report)
    assert "| safe_distributed | samples_per_update | 20 | 20 | 20 |" in text
    assert "| safe_distributed | samples_per_update_max | 96 | 96 | 96 |" in text
    assert "| safe_distributed | samples_per_update_min | 20 | 20 | 20 |" in text
