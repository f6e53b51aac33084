"""The picture `keras-safe-dist report --plot` draws: update statistics and NaN onsets.

One chart per update statistic (gradient norm with its spread over each
epoch's updates, clip rate, skipped updates, samples per update), one line
per run, as `read_log_dir` reads them; each NaN onset is a dashed vertical
line labelled with its epoch and batch.

matplotlib is an optional extra (`pip install "keras-safe-dist[plot]"`),
imported when a picture is drawn; it draws with its Agg canvas, off screen
(no pyplot, no window).
"""

import math
import os

from keras_safe_dist.core import _files
from keras_safe_dist.report._log_dir import LogDirReport
from keras_safe_dist.update.statistics import STATISTICS
from keras_safe_dist.update.statistics import spread_names

__all__ = ["INSTALL", "plot_report", "require_matplotlib"]

INSTALL = 'pip install "keras-safe-dist[plot]"'
_INSTALL_FROM_SOURCE = 'pip install -c constraints.txt -e ".[plot]"'
# The figure's size in inches: its width, each statistic's chart, and the
# title and x-axis label together.
WIDTH = 8.0
ROW_HEIGHT = 1.9
MARGIN = 0.9
_ONSET_COLOR = "tab:red"


def require_matplotlib():
    """Imports matplotlib, or says what is missing and how to install it.

    Returns:
        The `matplotlib` module.

    Raises:
        ModuleNotFoundError: when matplotlib is not installed; the message
            gives the command installing the `[plot]` extra.

    Example:

    ```python
    try:
        require_matplotlib()
    except ModuleNotFoundError as error:
        print(error)  # "... needs matplotlib ... pip install "keras-safe-dist[plot]" ..."
    ```
    """
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "matplotlib":
            raise
        raise ModuleNotFoundError(
            "the plot needs matplotlib, which is not installed. Install the [plot] "
            f"extra: `{INSTALL}` (from the repository's root: `{_INSTALL_FROM_SOURCE}`).",
            name="matplotlib",
        ) from None
    return matplotlib


def plot_report(report, path, dpi=100):
    """Draws each run's update statistics and the NaN onsets into an image file.

    Each statistic the runs logged gets a chart: its value per logged epoch
    (the epoch's last update), one line per run; the gradient norm's chart
    also shows its mean over each epoch's updates (dashed) and the band
    from their smallest to their largest. A run that logged no epoch (it
    stopped in its first) is drawn per logged update, from 1. Each NaN
    onset (`report.nan_onsets`) is a dashed vertical line on every chart,
    at its epoch, or for a run drawn per update at its step since `fit()`
    began plus 1 (the update's index when each update was charted and
    gradients were not accumulated), labelled with its epoch and batch.
    The file is written whole or not at all: beside `path`, then moved
    into place.

    Args:
        report: a `LogDirReport`, from `read_log_dir`.
        path: the image file to write; its suffix names the format
            (`.png`, `.svg`, `.pdf`...).
        dpi: dots per inch of a raster image; at the default 100 a PNG is
            800 pixels wide and 90 + 190 per statistic high.

    Returns:
        The `matplotlib.figure.Figure` written: its axes, one per
        statistic, hold the plotted values.

    Raises:
        TypeError: when `report` is not a `LogDirReport`, or `path` not a
            path.
        ValueError: when `report` holds no update statistics, `path`'s
            suffix is not a format matplotlib writes, or `dpi` is not a
            number > 0.
        FileNotFoundError: when `path`'s folder does not exist.
        ModuleNotFoundError: when matplotlib is not installed.

    Example:

    ```python
    from keras_safe_dist.report import plot_report, read_log_dir

    figure = plot_report(read_log_dir("logs"), "run.png")
    print([axes.get_title() for axes in figure.axes])
    ```
    """
    if not isinstance(report, LogDirReport):
        raise TypeError(
            f"`report` must be a LogDirReport (from read_log_dir). Received: report={report!r}"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a path (str or os.PathLike). Received: path={path!r}")
    if isinstance(dpi, bool) or not isinstance(dpi, (int, float)) or not dpi > 0:
        raise ValueError(f"`dpi` must be a number > 0. Received: dpi={dpi!r}")
    path = os.fspath(path)
    if not report.runs:
        raise ValueError(
            f"nothing to plot: no update statistics were logged under {report.log_dir}. "
            "They come from a SafeDistributedModel with a Dashboard, a NaNOnsetDetector "
            "or log_update_stats=True; a stock keras.Model logs none."
        )
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fmt = _format(path, FigureCanvasAgg(Figure()).get_supported_filetypes())
    remote = _files.remote(path)
    folder = path.rsplit("/", 1)[0] if remote else os.path.dirname(os.path.abspath(path))
    if not _files.isdir(folder):
        raise FileNotFoundError(f"the folder of `path` does not exist: {folder}")

    names = [n for n in STATISTICS if any(_logged(run, n) for run in report.runs)]
    figure = Figure(figsize=(WIDTH, MARGIN + ROW_HEIGHT * len(names)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for index, run in enumerate(report.runs):
        _draw_run(axes, names, run, f"C{index}")
    # Below the charts, for the runs' lines alone (the onsets are labelled where they are).
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3,
                  fontsize="small", frameon=False)
    for run, onset in report.nan_onsets:
        _draw_onset(axes, report.runs, run, onset, several=len(report.nan_onsets) > 1)
    for ax, name in zip(axes, names):
        ax.set_title(STATISTICS[name], loc="left", fontsize="medium")
        ax.grid(alpha=0.3)
        if name == "clip_rate":
            ax.set_ylim(-0.05, 1.05)  # a share
        elif name != "grad_norm":
            # A count, from 0.
            top = max(ax.dataLim.y1, 1.0)
            ax.set_ylim(-0.05 * top, 1.1 * top)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel(_x_label({run.per for run in report.runs}))
    figure.suptitle(f"keras-safe-dist report {report.log_dir}", fontsize="medium")
    _save(figure, path, fmt)
    return figure


def _format(path, supported):
    """The format matplotlib writes for `path`'s suffix; lists the others when it has none."""
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix not in supported:
        raise ValueError(
            f"`path` must end in the suffix of a format matplotlib writes: "
            f"{', '.join('.' + s for s in sorted(supported))}. Received: path={path!r}"
        )
    return suffix


def _logged(run, name):
    return any(n in run.values for n in (name, *spread_names(name)))


def _steps(run, count):
    """The x of a run's points: the epoch, from 0, or the update, from 1."""
    return list(range(count)) if run.per == "epoch" else list(range(1, count + 1))


def _finite(series):
    """The values, each non-finite one a gap (NaN)."""
    return [v if math.isfinite(v) else math.nan for v in series]


def _draw_run(axes, names, run, color):
    label = run.run if run.per == "epoch" else f"{run.run} (per update)"
    for ax, name in zip(axes, names):
        series = run.values.get(name)
        if series:
            ax.plot(_steps(run, len(series)), _finite(series), color=color, marker="o",
                    markersize=3, label=label)
        spread = {n.rpartition("_")[2]: run.values.get(n) for n in spread_names(name)}
        low, mean, high = (spread.get(part) for part in ("min", "mean", "max"))
        if mean:
            ax.plot(_steps(run, len(mean)), _finite(mean), color=color, linestyle="--",
                    linewidth=1, label=f"{label}: mean over the epoch's updates")
        if low and high and len(low) == len(high):
            ax.fill_between(_steps(run, len(low)), _finite(low), _finite(high), color=color,
                            alpha=0.15, linewidth=0, label=f"{label}: smallest to largest")


def _draw_onset(axes, runs, folder, onset, several):
    """A dashed line on every chart at the onset, and its label on the first."""
    # The runs written beside the nan_onset.json or below its folder.
    own = [r for r in runs if folder == "." or r.run == folder or r.run.startswith(folder + os.sep)]
    per = (own or runs)[0].per
    x = onset["epoch"] if per == "epoch" else onset.get("step", onset["batch"]) + 1
    color = _ONSET_COLOR
    if several and len(own) == 1:
        color = f"C{runs.index(own[0])}"
    where = "" if folder == "." else f" ({folder})"
    text = f"NaN onset{where}: epoch {onset['epoch']}, batch {onset['batch']}"
    for ax in axes:
        ax.axvline(x, color=color, linestyle="--", linewidth=1.5, label=text, gid="nan_onset")
    axes[0].text(
        x, 0.96, f" {text}", transform=axes[0].get_xaxis_transform(), color=color,
        ha="left", va="top", fontsize="small",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
    )


def _x_label(pers):
    if pers == {"epoch"}:
        return "epoch"
    if pers == {"update"}:
        return "update (the runs logged no epoch)"
    return "epoch, or update for the runs marked (per update)"


def _save(figure, path, fmt):
    """Writes the figure beside `path`, then moves it into place."""
    with _files.written_whole(path, "wb") as f:
        figure.savefig(f, format=fmt)
