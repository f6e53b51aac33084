"""The update statistics of each TensorBoard run under a log directory, read from its event files.

Values of `safe_distributed/<name>` (`Dashboard`'s) are preferred to
`epoch_<name>` (`keras.callbacks.TensorBoard`'s). Event files are read with the
`tensorboard` package's own protocol buffers, without TensorFlow.
"""

import dataclasses
import os
import struct

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as _masked_crc32c
from tensorboard.util import tensor_util

from keras_safe_dist.core import _files
from keras_safe_dist.update.statistics import LOG_NAMES
from keras_safe_dist.update.statistics import PREFIX
from keras_safe_dist.update.statistics import RUN as DASHBOARD_RUN

__all__ = ["RunStatistics", "each_statistic_once", "run_statistics"]


@dataclasses.dataclass
class RunStatistics:
    """The update statistics one TensorBoard run logged, per epoch.

    Args:
        run: the run's folder, relative to the log directory (`.` for the
            root).
        values: `{statistic: [value per logged epoch]}`, or per logged
            update when the run logged no epoch (it stopped in its first).
        per: `"epoch"`, or `"update"` for the Dashboard's per-update points.
        notes: what the reader noticed about the run's files (two writers
            at once).

    Example:

    ```python
    for run in read_log_dir("logs").runs:
        print(run.run, run.summary()["grad_norm"]["max"])
    ```
    """

    run: str
    values: dict
    per: str = "epoch"
    notes: list = dataclasses.field(default_factory=list)

    def summary(self):
        """`{statistic: {"last", "max", "mean"}}` over the logged epochs (or updates).

        Returns:
            A dict: for each statistic, a dict of its last, largest and mean
            value.
        """
        return {
            name: {
                "last": series[-1],
                "max": max(series),
                "mean": sum(series) / len(series),
            }
            for name, series in self.values.items()
        }


def each_statistic_once(runs):
    """Drops what a Dashboard run beside a run (Keras's `train`) already holds.

    `Dashboard` and `keras.callbacks.TensorBoard` given the same log
    directory log the same statistics, in sibling runs.
    """
    dashboards = {
        os.path.dirname(r.run): r.values
        for r in runs
        if os.path.basename(r.run) == DASHBOARD_RUN
    }
    kept = []
    for run in runs:
        beside = dashboards.get(os.path.dirname(run.run))
        if beside is not None and os.path.basename(run.run) != DASHBOARD_RUN:
            run = dataclasses.replace(
                run, values={k: v for k, v in run.values.items() if k not in beside}
            )
        if run.values:
            kept.append(run)
    return kept


def run_statistics(paths):
    """`(values, per, notes, damaged)` of one run's event files.

    `values` is `{statistic: [value per logged epoch]}`; values of
    `safe_distributed/<name>` (the Dashboard's) are preferred to
    `epoch_<name>` (keras.callbacks.TensorBoard's) for the same statistic.
    A run that logged no epoch (it stopped in its first) gives the
    Dashboard's per-update points instead, with `per` `"update"`. `notes`
    says when two files of the run were written at the same time (two runs
    with one log directory and run name), whose points are then merged.
    `damaged` lists `(path, problem)` for each file damaged part way: its
    values up to the damage are kept.
    """
    series = {}  # tag: [value, ...]
    epoch_tags = {f"{PREFIX}/{n}" for n in LOG_NAMES} | {f"epoch_{n}" for n in LOG_NAMES}
    update_tags = {f"{PREFIX}/update/{n}" for n in LOG_NAMES}
    spans = []  # (first, last wall time, path) of each file with statistics
    damaged = []
    for path in paths:
        times = []
        try:
            for event in _events(path):
                for value in event.summary.value:
                    if value.tag in epoch_tags or value.tag in update_tags:
                        series.setdefault(value.tag, []).append(_scalar(value))
                        times.append(event.wall_time)
        except (OSError, ValueError, DecodeError) as error:
            damaged.append((path, f"event file damaged, read up to it: {error}"))
        if times:
            spans.append((min(times), max(times), path))
    values, per = {}, "epoch"
    for name in LOG_NAMES:
        for tag in (f"{PREFIX}/{name}", f"epoch_{name}"):
            if tag in series:
                values[name] = series[tag]
                break
    if not values:
        per = "update"
        values = {n: series[f"{PREFIX}/update/{n}"] for n in LOG_NAMES if f"{PREFIX}/update/{n}" in series}
    notes = []
    spans.sort()
    latest = None  # (end, path) of the file written last among those before
    for start, end, path in spans:
        if latest is not None and start < latest[0]:
            notes.append(
                f"two writers overlapped: {os.path.basename(latest[1])} and "
                f"{os.path.basename(path)} were written at the same time (two runs with "
                "one log directory and run name?); their points are merged"
            )
        if latest is None or end > latest[0]:
            latest = (end, path)
    return values, per, notes, damaged


def _events(path):
    """The events of the event file `path`, each record's CRC-32Cs checked.

    A local file is read with `open()`, so that any name the file system
    holds is read (TensorBoard's TensorFlow-free reader encodes the path as
    UTF-8, which a folder named in another encoding is not); a remote one
    (`gs://`) with TensorFlow's `GFile`. Raises `ValueError` at a truncated
    or damaged record, after the events before it.
    """
    with _files.open_file(path, "rb") as f:
        while True:
            offset = f.tell()
            header = f.read(12)
            if not header:
                return
            length_bytes = header[:8]
            if len(header) < 12:
                raise ValueError(f"{path}: record truncated at byte {offset} (header)")
            if _masked_crc32c(length_bytes) != struct.unpack("<I", header[8:])[0]:
                raise ValueError(f"{path}: record at byte {offset} failed its header crc32 check")
            (length,) = struct.unpack("<Q", length_bytes)
            data, crc = f.read(length), f.read(4)
            if len(data) < length or len(crc) < 4:
                raise ValueError(f"{path}: record truncated at byte {offset} (data)")
            if _masked_crc32c(data) != struct.unpack("<I", crc)[0]:
                raise ValueError(f"{path}: record at byte {offset} failed its data crc32 check")
            yield event_pb2.Event.FromString(data)


def _scalar(value):
    if value.HasField("tensor"):
        return float(tensor_util.make_ndarray(value.tensor))
    return float(value.simple_value)
