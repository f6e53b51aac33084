"""`Dashboard`: SafeDistributedModel's update statistics in one TensorBoard view."""

import numbers
import os
import threading

import keras
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.util import tensor_util

from keras_safe_dist.audits.stock import warn_no_update_statistics
from keras_safe_dist.core import _files
from keras_safe_dist.core import _validate
from keras_safe_dist.report import _events
from keras_safe_dist.report import writer
from keras_safe_dist.scale_out.distributed import is_chief
from keras_safe_dist.scale_out.distributed import strategy_of
from keras_safe_dist.update.statistics import LOG_NAMES
from keras_safe_dist.update.statistics import PREFIX
from keras_safe_dist.update.statistics import RUN
from keras_safe_dist.update.statistics import SPREAD
from keras_safe_dist.update.statistics import STATISTICS
from keras_safe_dist.update.statistics import UPDATE_PREFIX
from keras_safe_dist.update.statistics import description

__all__ = ["Dashboard", "DASHBOARD_TITLE", "STATISTICS", "UPDATE_TITLE", "layout"]

DASHBOARD_TITLE = "safe distributed training"
UPDATE_TITLE = "safe distributed training, per update"


def layout(per_update=False):
    """The custom-scalars layout: a category with a chart per statistic.

    Each chart shows this callback's `safe_distributed/<name>` and the
    `epoch_<name>` that `keras.callbacks.TensorBoard` logs for the same value;
    the gradient norm and samples per update charts also show the epoch's
    min, mean and max over its updates (`<name>_min`, `_mean`, `_max`).

    Args:
        per_update: also a second category, `UPDATE_TITLE`, with a chart per
            statistic of `safe_distributed/update/<name>`, on the update axis.

    Returns:
        A `layout_pb2.Layout`.
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
    categories = [layout_pb2.Category(title=DASHBOARD_TITLE, chart=charts)]
    if per_update:
        updates = [
            layout_pb2.Chart(
                title=title, multiline=layout_pb2.MultilineChartContent(tag=[rf"^{UPDATE_PREFIX}/{name}$"])
            )
            for name, title in STATISTICS.items()
        ]
        categories.append(layout_pb2.Category(title=UPDATE_TITLE, chart=updates))
    return layout_pb2.Layout(category=categories)


def _layout_summary(layout):
    """The `Summary` of `custom_scalar.summary.pb(layout)`, which imports TensorFlow."""
    value = summary_pb2.Summary.Value(
        tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
        metadata=custom_scalar_metadata.create_summary_metadata(),
        tensor=tensor_util.make_tensor_proto(layout.SerializeToString()),
    )
    return summary_pb2.Summary(value=[value])


def _check_update_freq(update_freq):
    if isinstance(update_freq, str) and update_freq == "epoch":
        return update_freq
    integer = isinstance(update_freq, numbers.Integral) and not isinstance(update_freq, bool)
    if integer and update_freq >= 1:
        return int(update_freq)
    raise ValueError(
        '`update_freq` must be "epoch" or an integer >= 1 (chart every N-th update). '
        f"Received: update_freq={update_freq!r}. Pass 1 to chart every update, an "
        'integer N to chart every N-th, or "epoch" for the per-epoch charts only.'
    )


class Dashboard(keras.callbacks.Callback):
    """Logs update statistics and a "safe distributed training" dashboard.

    At train begin it writes TensorBoard's custom-scalars layout (once per
    run) grouping gradient norm, clip rate, skipped updates and samples per
    update. With an integer `update_freq` (default 1), it writes those
    values after every `update_freq`-th optimizer update as
    `safe_distributed/update/<name>` scalars, whose step is the update's
    index since `fit()` began (from 1; skipped non-finite updates count).
    With gradient accumulation an update spans several batches, and a point
    is written once per update, not per micro-batch. At each epoch end it
    writes the epoch's values as `safe_distributed/<name>` scalars, whose step
    is the epoch: the epoch's last update is `<name>`; for the gradient norm
    and the samples per update the epoch's min, mean and max over its
    applied updates are `<name>_min`, `<name>_mean` and `<name>_max`, on the
    same chart. Every scalar carries a description (what it is, its step, how
    to read it). With a plain `keras.Model`, whose logs lack these values,
    only the layout is written. Only the chief writes, and it writes its event
    file with the `tensorboard` package alone (`keras_safe_dist.report._events`): no
    TensorFlow needed.

    It reads only the logs Keras already computed and converted. Its batch
    hook reads no tensor and is safe for Keras's asynchronous callback
    dispatch (`async_safe`), so adding it leaves Keras's dispatch as it was:
    with no other batch hook, Keras converts each batch's logs in its worker
    threads, not on the training thread. With `steps_per_execution=S` Keras
    reports every S-th batch; a point then holds the latest update of the S
    batches.

    With a `SafeDistributedModel`, adding this callback to `fit()` turns on
    its `log_update_stats` for that `fit()`: the statistics also reach
    `History` and every other callback (Keras's `TensorBoard` logs them as
    `epoch_<name>`); the progress bar shows the loss and metrics alone.

    Args:
        log_dir: the TensorBoard log directory, the one given to
            `keras.callbacks.TensorBoard` if any.
        run: the TensorBoard run this callback writes, a folder of
            `log_dir` (beside Keras's `train` and `validation`).
        update_freq: an integer N >= 1, to chart every N-th update (the
            updates whose index is a multiple of N, or the next one Keras
            reports), or `"epoch"` for the per-epoch charts only. Assignable
            after construction.

    Raises:
        TypeError: when `log_dir` is not a path.
        ValueError: when `run` is not a plain folder name, or `update_freq`
            is neither `"epoch"` nor an integer >= 1.
        OSError: when training begins, on the chief, for a `log_dir` it
            cannot create or write (a file, a path below a file, no
            permission, a name too long), before any batch.

    Example:

    ```python
    model.fit(x, y, callbacks=[keras_safe_dist.callbacks.Dashboard("logs", update_freq=10)])
    # tensorboard --logdir logs  ->  "Custom Scalars" tab; the run "safe_distributed"
    ```
    """

    # Read by SafeDistributedModel.fit(): log the update statistics.
    requests_update_stats = True
    # Read by Keras's CallbackList: the batch hook may run in Keras's worker
    # threads. It reads no tensor (Keras hands it converted logs), takes a
    # lock, and writes the points in batch order whatever order they come in.
    async_safe = True

    def __init__(self, log_dir, run=RUN, update_freq=1):
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
        self.update_freq = update_freq
        self._writer = None
        self._lock = threading.Lock()

    @property
    def update_freq(self):
        """`"epoch"`, or N: chart every N-th update."""
        return self._update_freq

    @update_freq.setter
    def update_freq(self, value):
        self._update_freq = _check_update_freq(value)

    def on_train_begin(self, logs=None):
        self._close()
        warn_no_update_statistics(self.model, "Dashboard")
        # Updates before the current epoch, since this fit() began.
        self._updates = 0
        self._accumulation = int(getattr(self.model, "gradient_accumulation_steps", 1) or 1)
        self._execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self.on_epoch_begin(None)
        if not is_chief(strategy_of(self.model)):
            return
        # Before any training, with the message the other callbacks give.
        _validate.writable_directory("Dashboard", "log_dir", self.log_dir, optional=False)
        self._open()

    def _open(self):
        """A new event file, starting with the layout."""
        with writer.writing("Dashboard", self.log_dir):
            self._writer = _events.EventFileWriter(os.path.join(self.log_dir, self.run))
            # Each event file gives each tag's description once, with its first value.
            self._metadata = {
                name: scalar_metadata.create_summary_metadata(
                    display_name=name, description=description(name, per_update=True)
                )
                for name in STATISTICS
            }
            per_update = self.update_freq != "epoch"
            self._writer.write(0, _layout_summary(layout(per_update)))
            self._writer.flush()

    def on_epoch_begin(self, epoch, logs=None):
        with self._lock:
            self._pending = {}  # end step: logs, of batches not yet handled
            self._next_end = self._execution - 1
            self._batches = 0  # batches handled this epoch
            self._in_epoch = 0  # updates handled this epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is None or self.update_freq == "epoch":
            return
        with self._lock:
            self._pending[batch] = logs or {}
            while self._next_end in self._pending:
                end = self._next_end
                self._next_end += self._execution
                self._handle_batches(end + 1, self._pending.pop(end))

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if self._writer is None:
            return
        with self._lock:
            # Keras has run every batch hook of the epoch by now.
            for end in sorted(self._pending):
                self._handle_batches(end + 1, self._pending.pop(end))
            # An epoch's partial last group is applied by then: the epoch logs
            # hold its update.
            self._write_updates(-(-self._batches // self._accumulation), logs)
            self._updates += self._in_epoch
        # One event holding the epoch's values, each with its description.
        values = [
            _events.scalar(f"{PREFIX}/{name}", float(logs[name]), description=description(name))
            for name in LOG_NAMES
            if name in logs
        ]
        self._reopen_if_removed()
        with writer.writing("Dashboard", self.log_dir):
            if values:
                self._writer.write(epoch, values)
            self._writer.flush()

    def _reopen_if_removed(self):
        # The folder deleted during training: this epoch's points went to a
        # removed file. Say so once and write the next ones anew there.
        path = self._writer.path
        if _files.remote(path) or os.path.exists(path):
            return
        self._writer.close()
        writer.warn_recreated("Dashboard", path, os.path.join(self.log_dir, self.run))
        self._open()

    def on_train_end(self, logs=None):
        self._close()

    def _handle_batches(self, batches, logs):
        """The logs after the epoch's first `batches` batches (Keras's count)."""
        steps = self.params.get("steps") if self.params else None
        if steps and batches >= steps:
            batches = steps
        # Whole groups only: an epoch's partial last group is charted at the
        # epoch's end, from the epoch's logs (JAX applies it only then; the
        # last batch's logs hold the update before it).
        updates = batches // self._accumulation
        self._batches = max(self._batches, batches)
        self._write_updates(updates, logs)

    def _write_updates(self, updates, logs):
        """Writes the latest update of this epoch's `updates` if its turn has come."""
        if updates <= self._in_epoch or self.update_freq == "epoch":
            self._in_epoch = max(self._in_epoch, updates)
            return
        first, latest = self._updates + self._in_epoch + 1, self._updates + updates
        self._in_epoch = updates
        if latest // self.update_freq * self.update_freq < first:
            return  # no multiple of update_freq among the updates since the last batch
        # One Summary of all the statistics, one event: with tf.summary, one
        # tf.summary.scalar per value cost about 8 times as much as one event.
        values = []
        for name in STATISTICS:
            if name in logs:
                values.append(
                    summary_pb2.Summary.Value(
                        tag=f"{UPDATE_PREFIX}/{name}",
                        metadata=self._metadata.pop(name, None),
                        tensor=_events.float_tensor(logs[name]),
                    )
                )
        if values:
            with writer.writing("Dashboard", self.log_dir):
                self._writer.write(latest, values)

    def _close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
