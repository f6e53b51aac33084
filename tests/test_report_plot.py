"""`keras-safe-dist report LOGDIR --plot FILE` and `keras_safe_dist.report.plot_report`."""

import importlib.util
import json
import struct
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist import cli
from keras_safe_dist.report import LogDirReport
from keras_safe_dist.report import RunStatistics
from keras_safe_dist.report import plot_report
from keras_safe_dist.report import read_log_dir
from keras_safe_dist.update.statistics import STATISTICS

from conftest import strategy_for

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="the [plot] extra (matplotlib) is not installed"
)

EPOCHS, BATCHES, BATCH_SIZE = 4, 5, 4
ONSET = (2, 3)  # (epoch, batch) whose batch holds the poisoned sample


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    """A run whose inputs hold a NaN at epoch 2, batch 3; the detector skips it and goes on."""
    log_dir = tmp_path_factory.mktemp("logs")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(EPOCHS * BATCHES * BATCH_SIZE, 3)).astype("float32")
    y = x[:, :1] * 3.0
    epoch, batch = ONSET
    x[(epoch * BATCHES + batch) * BATCH_SIZE + 1, 2] = np.nan
    # One pass over the rows: with steps_per_epoch each epoch goes on where the last stopped.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)
    with strategy_for(2).scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), global_clipnorm=0.5)
        model.compile(optimizer="sgd", loss="mse")
    detector = callbacks.NaNOnsetDetector(log_dir=str(log_dir), action="continue")
    model.fit(data, steps_per_epoch=BATCHES, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[detector, callbacks.Dashboard(str(log_dir))])
    assert (detector.report["epoch"], detector.report["batch"]) == ONSET
    return log_dir


def png_size(path):
    """(width, height) from a PNG's IHDR chunk; fails for anything but a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run_cli(capsys, *argv):
    code = cli.main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def lines_labelled(ax, label):
    return [line for line in ax.get_lines() if line.get_label() == label]


def onset_lines(ax):
    return [line for line in ax.get_lines() if line.get_gid() == "nan_onset"]


@needs_matplotlib
def test_plot_draws_each_statistic_read_and_the_onset_at_its_epoch(log_dir, tmp_path):
    report = read_log_dir(log_dir)
    (run,) = report.runs
    figure = plot_report(report, tmp_path / "run.png")
    # 8 x (0.9 + 1.9 per statistic) inches at 100 dpi.
    assert png_size(tmp_path / "run.png") == (800, 90 + 190 * len(STATISTICS)) == (800, 850)
    assert [ax.get_title(loc="left") for ax in figure.axes] == list(STATISTICS.values())
    for ax, name in zip(figure.axes, STATISTICS):
        (line,) = lines_labelled(ax, "safe_distributed")
        assert list(line.get_xdata()) == list(range(EPOCHS))
        assert list(line.get_ydata()) == pytest.approx(run.values[name])
        (onset,) = onset_lines(ax)
        assert list(onset.get_xdata()) == [ONSET[0]] * 2
        assert onset.get_label() == "NaN onset: epoch 2, batch 3"
    grad_norm = figure.axes[0]
    (mean,) = lines_labelled(grad_norm, "safe_distributed: mean over the epoch's updates")
    assert list(mean.get_ydata()) == pytest.approx(run.values["grad_norm_mean"])
    (band,) = grad_norm.collections
    heights = band.get_paths()[0].vertices[:, 1]
    assert (heights.min(), heights.max()) == pytest.approx(
        (min(run.values["grad_norm_min"]), max(run.values["grad_norm_max"]))
    )
    assert [t.get_text() for t in grad_norm.texts] == [" NaN onset: epoch 2, batch 3"]
    assert figure.axes[-1].get_xlabel() == "epoch"
    # The skipped update shows from the onset's epoch on.
    (skipped,) = lines_labelled(figure.axes[list(STATISTICS).index("skipped_updates")], "safe_distributed")
    assert list(skipped.get_ydata()) == [0, 0, 1, 1]


@needs_matplotlib
def test_report_plot_prints_the_text_and_writes_the_picture(log_dir, tmp_path, capsys):
    path = tmp_path / "run.png"
    code, out, err = run_cli(capsys, str(log_dir), "--plot", str(path))
    assert code == 1  # NAN001 fails the report, as without --plot
    assert "NaN onset at epoch 2, batch 3" in out
    assert "| safe_distributed | skipped_updates | 1 | 1 | 0.5 |" in out
    assert err == f"keras-safe-dist report: wrote the plot to {path}\n"
    assert png_size(path) == (800, 850)
    assert [p.name for p in tmp_path.iterdir()] == ["run.png"]  # no temporary file left
    # With --json stdout holds the JSON alone.
    code, out, err = run_cli(capsys, str(log_dir), "--json", "--plot", str(tmp_path / "run.svg"))
    assert (code, json.loads(out)["nan_onsets"][0]["batch"]) == (1, 3)
    assert (tmp_path / "run.svg").read_text().lstrip().startswith("<?xml")


def test_report_plot_without_matplotlib_names_the_extra(log_dir, tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m.partition(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    code, out, err = run_cli(capsys, str(log_dir), "--plot", str(tmp_path / "run.png"))
    assert (code, out) == (2, "")
    assert err == (
        "keras-safe-dist report: --plot: the plot needs matplotlib, which is not installed. "
        'Install the [plot] extra: `pip install "keras-safe-dist[plot]"` (from the '
        "repository's root: `pip install -c constraints.txt -e \".[plot]\"`).\n"
    )
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ModuleNotFoundError, match=r"keras-safe-dist\[plot\]"):
        plot_report(read_log_dir(log_dir), tmp_path / "run.png")


@needs_matplotlib
def test_report_plot_of_a_log_dir_without_statistics_says_why(tmp_path, capsys):
    onset = {"epoch": 0, "batch": 4, "kind": "inputs", "layer": None, "replica": 0, "variables": [], "history": []}
    (tmp_path / "nan_onset.json").write_text(json.dumps(onset))
    path = tmp_path / "run.png"
    code, out, err = run_cli(capsys, str(tmp_path), "--plot", str(path))
    assert code == 2
    assert "NaN onset:\nepoch 0, batch 4: first non-finite inputs, on replica 0." in out
    assert err == (
        f"keras-safe-dist report: --plot: nothing to plot: no update statistics were logged "
        f"under {tmp_path}. They come from a SafeDistributedModel with a Dashboard, a "
        "NaNOnsetDetector or log_update_stats=True; a stock keras.Model logs none.\n"
    )
    assert not path.exists()


@needs_matplotlib
def test_report_plot_names_a_bad_file_and_writes_nothing(log_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, str(log_dir), "--plot", str(tmp_path / "run.txt"))
    assert code == 2
    assert err.startswith("keras-safe-dist report: --plot: `path` must end in the suffix of a format matplotlib writes: ")
    assert ".pdf" in err and ".png" in err and ".svg" in err
    assert err.endswith(f"Received: path='{tmp_path / 'run.txt'}'\n")
    missing = tmp_path / "no such folder"
    code, _, err = run_cli(capsys, str(log_dir), "--plot", str(missing / "run.png"))
    assert code == 2
    assert err == f"keras-safe-dist report: --plot: the folder of `path` does not exist: {missing}\n"
    assert list(tmp_path.iterdir()) == []


@needs_matplotlib
def test_plot_report_validates_its_arguments(tmp_path):
    report = LogDirReport("logs", [], [], [RunStatistics("safe_distributed", {"clip_rate": [0.5]})])
    with pytest.raises(TypeError, match=r"`report` must be a LogDirReport .* Received: report='logs'"):
        plot_report("logs", tmp_path / "run.png")
    with pytest.raises(TypeError, match=r"`path` must be a path .* Received: path=3"):
        plot_report(report, 3)
    with pytest.raises(ValueError, match=r"`dpi` must be a number > 0. Received: dpi=0"):
        plot_report(report, tmp_path / "run.png", dpi=0)
    plot_report(report, tmp_path / "run.png", dpi=50)
    assert png_size(tmp_path / "run.png") == (400, 140)  # 8 x 2.8 inches: one statistic


@needs_matplotlib
def test_per_update_runs_and_each_runs_onset_in_its_colour(tmp_path):
    runs = [
        RunStatistics("a/safe_distributed", {"grad_norm": [1.0, 2.0, float("inf")]}, per="update"),
        RunStatistics("b/safe_distributed", {"grad_norm": [1.0, 1.5], "skipped_updates": [0.0, 1.0]}, per="update"),
    ]
    onsets = [("a", {"epoch": 0, "batch": 2, "step": 2, "kind": "loss"}), ("b", {"epoch": 0, "batch": 1, "kind": "inputs"})]
    figure = plot_report(LogDirReport("logs", [], onsets, runs), tmp_path / "run.png")
    grad_norm, skipped = figure.axes
    (a,) = lines_labelled(grad_norm, "a/safe_distributed (per update)")
    assert list(a.get_xdata()) == [1, 2, 3]
    assert list(a.get_ydata())[:2] == [1.0, 2.0] and np.isnan(a.get_ydata()[2])  # inf: a gap
    assert [line.get_label() for line in lines_labelled(skipped, "b/safe_distributed (per update)")] == [
        "b/safe_distributed (per update)"
    ]
    # Each onset on the update axis (its step + 1; the batch + 1 without a step), in its run's colour.
    first, second = onset_lines(skipped)
    assert (first.get_xdata()[0], first.get_color()) == (3, "C0")
    assert (second.get_xdata()[0], second.get_color()) == (2, "C1")
    assert [t.get_text() for t in grad_norm.texts] == [
        " NaN onset (a): epoch 0, batch 2", " NaN onset (b): epoch 0, batch 1"
    ]
    assert figure.axes[-1].get_xlabel() == "update (the runs logged no epoch)"


@needs_matplotlib
def test_the_plot_goes_to_a_remote_path_and_a_missing_remote_folder_is_named(log_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = "ram://report_plot"
    tf.io.gfile.makedirs(root)
    plot_report(read_log_dir(log_dir), f"{root}/run.png")
    with tf.io.gfile.GFile(f"{root}/run.png", "rb") as f:
        (tmp_path / "copy.png").write_bytes(f.read())
    assert png_size(tmp_path / "copy.png") == (800, 850)
    assert tf.io.gfile.listdir(root) == ["run.png"]  # no temporary file left
    with pytest.raises(FileNotFoundError, match=f"the folder of `path` does not exist: {root}/missing$"):
        plot_report(read_log_dir(log_dir), f"{root}/missing/run.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.png"]  # nothing written locally
