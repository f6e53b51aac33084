"""The Dashboard charts every N-th update, and each epoch's spread over its updates."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist.callbacks.dashboard import DASHBOARD_TITLE
from keras_safe_dist.callbacks.dashboard import UPDATE_TITLE
from keras_safe_dist.report import format_text
from keras_safe_dist.report import read_log_dir
from keras_safe_dist.update.statistics import LOG_NAMES
from keras_safe_dist.update.statistics import STATISTICS
from keras_safe_dist.update.statistics import UPDATE_PREFIX
from keras_safe_dist.update.statistics import description

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
    # Per update, with Keras's asynchronous callback dispatch (no other batch hook here).
    assert points(events, "samples_per_update") == list(enumerate(sizes + sizes, start=1))
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


class RecordBatches(keras.callbacks.Callback):
    """The update statistics of each batch's logs, as the model returned them."""

    def on_train_begin(self, logs=None):
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({name: float(logs[name]) for name in STATISTICS})


def fit_with_dashboard(tmp_path, replicas, samples, batch, steps=1, epochs=1, **dashboard):
    x, y, _ = regression_data(samples)
    with strategy_for(replicas).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=steps)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    recorder = RecordBatches()
    history = model.fit(
        x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[callbacks.Dashboard(tmp_path, **dashboard), recorder],
    ).history
    events = event_accumulator.EventAccumulator(str(tmp_path / "safe_distributed"), size_guidance={"tensors": 0})
    events.Reload()
    return events, recorder.logs, history


def points(events, name):
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(f"{UPDATE_PREFIX}/{name}")]


def test_every_update_is_charted_with_the_values_of_the_model_logs(tmp_path, replicas):
    # 9 updates of 16 samples, then one of 8: 10 updates, 10 points per statistic.
    events, logged, history = fit_with_dashboard(tmp_path, replicas, 9 * 16 + 8, batch=16)
    assert len(logged) == 10
    for name in STATISTICS:
        assert [step for step, _ in points(events, name)] == list(range(1, 11))
        assert [value for _, value in points(events, name)] == pytest.approx([log[name] for log in logged], rel=1e-6)
    assert [value for _, value in points(events, "samples_per_update")] == [16.0] * 9 + [8.0]
    assert len({value for _, value in points(events, "grad_norm")}) == 10  # one norm per update
    # The epoch charts stay on the epoch axis, with the epoch's last update.
    assert [e.step for e in events.Tensors("safe_distributed/samples_per_update")] == [0]
    assert scalars(events, "safe_distributed/samples_per_update") == history["samples_per_update"] == [8.0]


def test_update_freq_charts_the_updates_whose_index_is_a_multiple(tmp_path, replicas):
    # 2 epochs of 10 updates; update_freq=3 charts updates 3, 6, ..., 18 (3 points in
    # the first epoch, 3 in the second), counted across epochs.
    events, logged, history = fit_with_dashboard(tmp_path, replicas, 9 * 16 + 8, batch=16, epochs=2, update_freq=3)
    assert [step for step, _ in points(events, "samples_per_update")] == [3, 6, 9, 12, 15, 18]
    assert [value for _, value in points(events, "grad_norm")] == pytest.approx(
        [logged[step - 1]["grad_norm"] for step in (3, 6, 9, 12, 15, 18)], rel=1e-6
    )
    assert [e.step for e in events.Tensors("safe_distributed/grad_norm")] == [0, 1]
    assert scalars(events, "safe_distributed/grad_norm") == pytest.approx(history["grad_norm"], rel=1e-6)


def test_gradient_accumulation_charts_one_point_per_update(tmp_path, replicas):
    # 3 micro-batches of 32 per update: 5 updates of 96 samples, then the epoch's partial
    # group of 20 (one micro-batch): 16 batches, 6 updates per epoch, 12 points in 2 epochs.
    events, logged, _ = fit_with_dashboard(tmp_path, replicas, 5 * 96 + 20, batch=32, steps=3, epochs=2)
    assert len(logged) == 2 * 16
    assert points(events, "samples_per_update") == [(step, 96.0) for step in range(1, 6)] + [(6, 20.0)] + [
        (step, 96.0) for step in range(7, 12)
    ] + [(12, 20.0)]
    # Each point is the batch that completed its update (batches 3, 6, ..., 15, 16 of each epoch).
    last_batches = [epoch * 16 + b for epoch in (0, 1) for b in (2, 5, 8, 11, 14, 15)]
    assert [value for _, value in points(events, "grad_norm")] == pytest.approx(
        [logged[b]["grad_norm"] for b in last_batches], rel=1e-6
    )


def test_each_chart_says_what_it_shows(tmp_path):
    events, _, _ = fit_with_dashboard(tmp_path, 1, 64, batch=16)
    for name in STATISTICS:
        text = events.SummaryMetadata(f"{UPDATE_PREFIX}/{name}").summary_description
        assert text == description(name, per_update=True)
        assert "Step: the update's index since fit() began, from 1" in text
    for name in LOG_NAMES:
        text = events.SummaryMetadata(f"safe_distributed/{name}").summary_description
        assert text == description(name) and "Step: the epoch, from 0." in text
    assert description("grad_norm", per_update=True).startswith(
        "Global L2 norm of the all-reduced gradient of this update, before clipping."
    )
    assert "smoothing 0 and 'Ignore outliers in chart scaling' off" in description("grad_norm_max")
    # The layout adds a category for the per-update charts.
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(tf.make_ndarray(config.tensor_proto).item())
    assert [c.title for c in layout.category] == [DASHBOARD_TITLE, UPDATE_TITLE]
    assert [list(c.multiline.tag) for c in layout.category[1].chart] == [
        [f"^safe_distributed/update/{name}$"] for name in STATISTICS
    ]


def test_update_freq_epoch_writes_the_epoch_charts_only(tmp_path):
    events, _, history = fit_with_dashboard(tmp_path, 1, 64, batch=16, epochs=2, update_freq="epoch")
    tags = events.Tags()["tensors"]
    assert not [tag for tag in tags if tag.startswith(f"{UPDATE_PREFIX}/")]
    assert scalars(events, "safe_distributed/samples_per_update") == history["samples_per_update"] == [16.0, 16.0]
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(tf.make_ndarray(config.tensor_proto).item())
    assert [c.title for c in layout.category] == [DASHBOARD_TITLE]


@pytest.mark.parametrize("per_update", [False, True])
def test_layout_event_is_the_one_tensorboard_builds_with_tensorflow(per_update):
    from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary

    from keras_safe_dist.callbacks import dashboard

    # custom_scalar.summary.pb imports TensorFlow; the Dashboard builds the same bytes without it.
    expected = custom_scalar_summary.pb(dashboard.layout(per_update)).SerializeToString()
    assert dashboard._layout_summary(dashboard.layout(per_update)).SerializeToString() == expected


@pytest.mark.parametrize("bad", [0, -1, "batchy", "batch", 2.0, True, None])
def test_bad_update_freq_says_what_is_expected(bad):
    message = (
        '`update_freq` must be "epoch" or an integer >= 1 (chart every N-th update). '
        f"Received: update_freq={bad!r}. Pass 1 to chart every update, an integer N to chart "
        'every N-th, or "epoch" for the per-epoch charts only.'
    )
    with pytest.raises(ValueError) as error:
        callbacks.Dashboard("logs", update_freq=bad)
    assert str(error.value) == message
    dashboard = callbacks.Dashboard("logs", update_freq=np.int64(5))
    assert dashboard.update_freq == 5 and type(dashboard.update_freq) is int
    with pytest.raises(ValueError) as error:
        dashboard.update_freq = bad
    assert str(error.value) == message
    assert dashboard.update_freq == 5


def test_points_are_written_in_update_order_whatever_order_the_hooks_run(tmp_path):
    # Keras may run batch hooks in its worker threads (the Dashboard is async_safe):
    # a hook may come before the one of the batch before it.
    with strategy_for(1).scope():
        inputs = keras.Input((4,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
    dashboard = callbacks.Dashboard(tmp_path)
    dashboard.set_model(model)
    dashboard.set_params({"epochs": 1, "steps": 3})
    dashboard.on_train_begin()
    dashboard.on_epoch_begin(0)
    logs = {batch: {name: 10.0 * batch + i for i, name in enumerate(STATISTICS)} for batch in range(3)}
    for batch in (1, 2, 0):
        dashboard.on_train_batch_end(batch, logs[batch])
    dashboard.on_epoch_end(0, logs[2])
    dashboard.on_train_end()
    events = event_accumulator.EventAccumulator(str(tmp_path / "safe_distributed"), size_guidance={"tensors": 0})
    events.Reload()
    assert points(events, "grad_norm") == [(1, 0.0), (2, 10.0), (3, 20.0)]
    assert points(events, "samples_per_update") == [(1, 3.0), (2, 13.0), (3, 23.0)]
