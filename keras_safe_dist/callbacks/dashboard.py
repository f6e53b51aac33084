"""`Dashboard`: SafeDistributedModel's update statistics in one TensorBoard view."""

import os

import keras
import tensorflow as tf
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary

from keras_safe_dist import _validate
from keras_safe_dist.audits.stock import warn_no_update_statistics
from keras_safe_dist.distributed import is_chief
from keras_safe_dist.distributed import strategy_of
from keras_safe_dist.statistics import LOG_NAMES
from keras_safe_dist.statistics import PREFIX
from keras_safe_dist.statistics import RUN
from keras_safe_dist.statistics import SPREAD
from keras_safe_dist.statistics import STATISTICS

__all__ = ["Dashboard", "DASHBOARD_TITLE", "STATISTICS", "layout"]

DASHBOARD_TITLE = "safe distributed training"


def layout():
    """The custom-scalars layout: one category, a chart per statistic.

    Each chart shows this callback's `safe_distributed/<name>` and the
    `epoch_<name>` that `keras.callbacks.TensorBoard` logs for the same value;
    the gradient norm and samples per update charts also show the epoch's
    min, mean and max over its updates (`<name>_min`, `_mean`, `_max`).
    """
    charts = []
    for name, title in STATISTICS.items():
        parts = SPREAD.get(name)
        suffix = f"(_{'|_'.join(parts)})?" if parts else ""
        charts.append(
            layout_pb2.Chart(
                title=title,
                multiline=layout_pb2.MultilineChartContent(
                    tag=[rf"^{PREFIX}/{name}{suffix}$", rf"^epoch_{name}{suffix}$"]
                ),
            )
        )
    return layout_pb2.Layout(
        category=[layout_pb2.Category(title=DASHBOARD_TITLE, chart=charts)]
    )


class Dashboard(keras.callbacks.Callback):
    """Logs update statistics and a "safe distributed training" dashboard.

    At train begin it writes TensorBoard's custom-scalars layout (once per
    run) grouping gradient norm, clip rate, skipped updates and samples per
    update; at each epoch end it writes those values from the epoch logs of a
    `SafeDistributedModel` as `safe_distributed/<name>` scalars. The epoch's
    last update is `<name>`; for the gradient norm and the samples per update
    the epoch's min, mean and max over its applied updates are
    `<name>_min`, `<name>_mean` and `<name>_max`, on the same chart. It reads only
    the logs Keras already computed (no extra host sync) and has no batch
    hook. With a plain `keras.Model`, whose logs lack these values, only the
    layout is written. Only the chief writes.

    With a `SafeDistributedModel`, adding this callback to `fit()` turns on
    its `log_update_stats` for that `fit()`: the statistics also appear in
    `History` and the progress bar.

    Args:
        log_dir: the TensorBoard log directory, the one given to
            `keras.callbacks.TensorBoard` if any.
        run: the TensorBoard run this callback writes, a folder of
            `log_dir` (beside Keras's `train` and `validation`).

    Raises:
        TypeError: when `log_dir` is not a path.
        ValueError: when `run` is not a plain folder name.
        OSError: when training begins, on the chief, for a `log_dir` it
            cannot create or write (a file, a path below a file, no
            permission, a name too long), before any batch.

    Example:

    ```python
    model.fit(x, y, callbacks=[keras_safe_dist.callbacks.Dashboard("logs")])
    # tensorboard --logdir logs  ->  "Custom Scalars" tab; the run "safe_distributed"
    ```
    """

    # Read by SafeDistributedModel.fit(): log the update statistics.
    requests_update_stats = True

    def __init__(self, log_dir, run=RUN):
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                "`log_dir` must be a path (str or os.PathLike). "
                f"Received: log_dir={log_dir!r}"
            )
        if not isinstance(run, str) or not run or os.path.basename(run) != run or run in (".", ".."):
            raise ValueError(
                "`run` must be a folder name, without separators. "
                f"Received: run={run!r}"
            )
        self.log_dir = os.fspath(log_dir)
        self.run = run
        self._writer = None

    def on_train_begin(self, logs=None):
        self._close()
        warn_no_update_statistics(self.model, "Dashboard")
        if not is_chief(strategy_of(self.model)):
            return
        # Before any training, with the message the other callbacks give.
        _validate.writable_directory("Dashboard", "log_dir", self.log_dir, optional=False)
        self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, self.run))
        with self._writer.as_default():
            tf.summary.experimental.write_raw_pb(
                custom_scalar_summary.pb(layout()).SerializeToString(), step=0
            )
        self._writer.flush()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if self._writer is None:
            return
        with self._writer.as_default():
            for name in LOG_NAMES:
                if name in logs:
                    tf.summary.scalar(f"{PREFIX}/{name}", float(logs[name]), step=epoch)
        self._writer.flush()

    def on_train_end(self, logs=None):
        self._close()

    def _close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
