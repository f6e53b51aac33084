"""An event file writer: TensorBoard's event files, written without TensorFlow.

Writes what `tf.summary.create_file_writer` writes, with the `tensorboard`
package alone: a file named `events.out.tfevents.<time>.<host>.<pid>.<n>.v2`
whose first record is the `file_version: "brain.Event:2"` event, then one
record per `Event`, framed as TFRecords (length, masked CRC-32C of the length,
data, masked CRC-32C of the data) by tensorboard's `RecordWriter`.
`scalar` and `text` build the values `tf.summary.scalar` and
`tf.summary.text` write, so TensorBoard reads them the same.

tensorboard's own `EventFileWriter` is not used: it goes through
`tensorboard.compat.tf`, which imports TensorFlow whenever it is installed
(seconds of start-up for a JAX user who also has TensorFlow). Local files are
plain Python files; only remote paths (`gs://...`, anything with `://`) go
through `tensorboard.compat.tf.io.gfile`, imported for them alone.

This module imports nothing from keras_safe_dist, nor any backend library.
"""

import contextlib
import os
import socket
import threading
import time

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

__all__ = ["EventFileWriter", "float_tensor", "scalar", "text"]

FILE_VERSION = "brain.Event:2"
_SCALAR_SHAPE = tensor_shape_pb2.TensorShapeProto()

# The n of the file names: distinct files for writers made in one second.
_counter = 0
_counter_lock = threading.Lock()


def float_tensor(value):
    """`value` as the float32 scalar `TensorProto` that `tf.summary.scalar` writes.

    Built directly: equal to `tensor_util.make_tensor_proto(np.float32(value))`,
    in a fifth of the time (2 us against 10 us; a Dashboard point holds four).
    """
    return tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT, float_val=[float(value)], tensor_shape=_SCALAR_SHAPE
    )


def scalar(tag, value, description=None):
    """A `Summary.Value` as `tf.summary.scalar(tag, value, description=...)` writes it.

    Returns:
        A `summary_pb2.Summary.Value`: a float32 scalar tensor and the scalars
        plugin's metadata, with `description` if given.
    """
    metadata = scalar_metadata.create_summary_metadata(display_name=None, description=description)
    return summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=float_tensor(value))


def text(tag, markdown):
    """A `Summary.Value` as `tf.summary.text(tag, markdown)` writes it.

    Returns:
        A `summary_pb2.Summary.Value`: a string scalar tensor and the text
        plugin's metadata.
    """
    metadata = text_metadata.create_summary_metadata(display_name=None, description=None)
    tensor = tensor_util.make_tensor_proto(markdown)
    return summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)


class EventFileWriter:
    """Writes `Event`s to a new event file in `log_dir`, from any thread.

    Creates `log_dir` if needed and the file at once, with its file-version
    event. Writes are buffered: `flush()` sends them to the file, `close()`
    flushes and closes it. Each method takes a lock, so threads may share a
    writer; each event is one whole record.

    Args:
        log_dir: the directory, local or remote (a path with `://`).

    Raises:
        OSError: when the directory or the file cannot be created; later,
            from `write`, `flush` and `close`, when the file cannot be
            written (a full disk), naming the file.

    Example:

    ```python
    with EventFileWriter("logs/run") as writer:
        writer.write(step=3, values=[scalar("loss", 0.25), text("notes", "**ok**")])
    ```
    """

    def __init__(self, log_dir):
        log_dir = os.fspath(log_dir)
        self._lock = threading.Lock()
        now = time.time()
        self._path, file = _new_file(log_dir, now)
        self._records = RecordWriter(file)
        self.write_event(
            event_pb2.Event(
                wall_time=now,
                file_version=FILE_VERSION,
                source_metadata=event_pb2.SourceMetadata(writer="keras_safe_dist"),
            )
        )
        self.flush()

    @property
    def path(self):
        """The event file's path."""
        return self._path

    def write(self, step, values):
        """Writes one event at `step` holding `values`.

        Args:
            step: the step, an integer.
            values: a `summary_pb2.Summary`, or `Summary.Value`s (from
                `scalar` and `text`).
        """
        if not isinstance(values, summary_pb2.Summary):
            values = summary_pb2.Summary(value=values)
        self.write_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=values))

    def write_event(self, event):
        """Writes `event`, an `event_pb2.Event`, as one record."""
        data = event.SerializeToString()
        with self._lock:
            self._check_open()
            with _naming(self._path):
                self._records.write(data)

    def flush(self):
        """Sends the events written so far to the file."""
        with self._lock:
            self._check_open()
            with _naming(self._path):
                self._records.flush()

    def close(self):
        """Flushes and closes the file; later calls do nothing."""
        with self._lock:
            if self._records is None:
                return
            records, self._records = self._records, None
            with _naming(self._path):
                records.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._records is None:
            raise ValueError(
                f"The event file writer of {self._path!r} is closed; make a new EventFileWriter."
            )


@contextlib.contextmanager
def _naming(path):
    """Re-raises an `OSError` that names no file (a full disk's) as one naming `path`."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        if error.errno is None:
            raise type(error)(f"{error} (writing the event file {path!r})") from error
        # Reads "[Errno 28] No space left on device: '<path>'".
        raise type(error)(error.errno, error.strerror, path) from error


def _file_name(now):
    """tf.summary's name: `events.out.tfevents.<time>.<host>.<pid>.<n>.v2`."""
    global _counter
    with _counter_lock:
        number, _counter = _counter, _counter + 1
    return f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{number}.v2"


def _new_file(log_dir, now):
    """Creates `log_dir` if needed and a new event file in it: `(path, binary file)`."""
    if "://" in log_dir:
        # Remote file systems need tf.io.gfile (TensorFlow, for gs://): for them alone.
        from tensorboard.compat import tf

        tf.io.gfile.makedirs(log_dir)
        path = log_dir.rstrip("/") + "/" + _file_name(now)
        return path, tf.io.gfile.GFile(path, "wb")
    os.makedirs(log_dir, exist_ok=True)
    while True:
        path = os.path.join(log_dir, _file_name(now))
        try:
            # "x": never truncates a file of that name. tf.summary's writers count
            # from 0 too, and one of them may have made one here in the same second.
            return path, open(path, "xb")
        except FileExistsError:
            continue
