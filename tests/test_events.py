"""Event files written without TensorFlow read back in TensorBoard as tf.summary's do."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors as record_errors
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.util import tensor_util

from keras_safe_dist.report import _events


def records(path):
    """Every event of the file at `path`, in order (tensorboard's own reader)."""
    reader = pywrap_tensorflow.PyRecordReader_New(path)
    events = []
    while True:
        try:
            reader.GetNext()
        except record_errors.OutOfRangeError:
            return events
        events.append(event_pb2.Event.FromString(reader.record()))


def accumulator(log_dir):
    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return events


def values(events, tag):
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]


def test_scalars_and_texts_read_back_with_their_steps_values_and_descriptions(tmp_path):
    with _events.EventFileWriter(tmp_path) as writer:
        for step in range(3):
            writer.write(step, [_events.scalar("loss", 0.5 * step, description="the loss")])
        writer.write(7, [_events.text("notes", "| a | b |"), _events.scalar("count", 3)])
    events = accumulator(tmp_path)
    assert values(events, "loss") == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert values(events, "count") == [(7, 3.0)]
    assert values(events, "notes") == [(7, b"| a | b |")]
    assert sorted(events.Tags()["tensors"]) == ["count", "loss", "notes"]
    assert events.SummaryMetadata("loss").summary_description == "the loss"
    assert events.SummaryMetadata("loss").plugin_data.plugin_name == "scalars"
    assert events.SummaryMetadata("notes").plugin_data.plugin_name == "text"


def test_values_are_those_tf_summary_writes(tmp_path):
    import tensorflow as tf

    with tf.summary.create_file_writer(str(tmp_path / "tf")).as_default() as writer:
        tf.summary.scalar("loss", 0.25, step=4, description="the loss")
        tf.summary.text("notes", "**ok**", step=4)
    writer.flush()
    (tf_file,) = os.listdir(tmp_path / "tf")
    tf_values = [v for e in records(str(tmp_path / "tf" / tf_file))[1:] for v in e.summary.value]
    ours = [_events.scalar("loss", 0.25, description="the loss"), _events.text("notes", "**ok**")]
    assert [v.tag for v in ours] == [v.tag for v in tf_values] == ["loss", "notes"]
    for mine, theirs in zip(ours, tf_values):
        assert mine.metadata == theirs.metadata
        assert mine.tensor.dtype == theirs.tensor.dtype
        assert mine.tensor.tensor_shape == theirs.tensor.tensor_shape  # a scalar
        assert tensor_util.make_ndarray(mine.tensor).item() == tensor_util.make_ndarray(theirs.tensor).item()


@pytest.mark.parametrize("value", [0.1, 3, -2.5e-8, float("nan"), np.float64(1e40)])
def test_float_tensor_equals_what_make_tensor_proto_builds(value):
    with np.errstate(over="ignore"):  # 1e40 is inf in float32, as tf.summary.scalar writes it
        expected = tensor_util.make_tensor_proto(np.float32(value))
    assert _events.float_tensor(value).SerializeToString() == expected.SerializeToString()


def test_the_first_record_is_the_file_version_event(tmp_path):
    with _events.EventFileWriter(tmp_path) as writer:
        writer.write(5, [_events.scalar("a", 1.0)])
    first, second = records(writer.path)
    assert first.file_version == "brain.Event:2"
    assert not first.HasField("summary")
    assert (second.step, second.summary.value[0].tag) == (5, "a")
    assert first.wall_time <= second.wall_time


def test_the_file_is_named_as_tf_summary_names_it(tmp_path):
    before = int(time.time())
    writer = _events.EventFileWriter(tmp_path)
    after = int(time.time())
    writer.close()
    name = os.path.basename(writer.path)
    assert os.path.dirname(writer.path) == str(tmp_path)
    pattern = rf"events\.out\.tfevents\.(\d{{10}})\.{re.escape(socket.gethostname())}\.{os.getpid()}\.\d+\.v2"
    match = re.fullmatch(pattern, name)
    assert match, name
    assert before <= int(match.group(1)) <= after
    assert os.listdir(tmp_path) == [name]


def test_two_writers_in_one_second_write_two_files(tmp_path, monkeypatch):
    monkeypatch.setattr(_events.time, "time", lambda: 1700000000.25)
    with _events.EventFileWriter(tmp_path) as first, _events.EventFileWriter(tmp_path) as second:
        first.write(1, [_events.scalar("a", 1.0)])
        second.write(2, [_events.scalar("a", 2.0)])
    monkeypatch.undo()
    assert first.path != second.path
    assert ".tfevents.1700000000." in first.path and ".tfevents.1700000000." in second.path
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(first.path), os.path.basename(second.path)])
    # Both files are read (TensorBoard orders files by name: the counter decides, not the steps).
    assert sorted(values(accumulator(tmp_path), "a")) == [(1, 1.0), (2, 2.0)]


def test_a_file_of_the_same_name_is_not_truncated(tmp_path, monkeypatch):
    # A tf.summary writer counts from 0 too: its file may already bear the next name.
    monkeypatch.setattr(_events.time, "time", lambda: 1700000000.25)
    with _events.EventFileWriter(tmp_path) as first:
        number = int(first.path.split(".")[-2])
        taken = first.path[: -len(f"{number}.v2")] + f"{number + 1}.v2"
        with open(taken, "wb") as file:
            file.write(b"not ours")
        with _events.EventFileWriter(tmp_path) as second:
            pass
    assert second.path not in (first.path, taken)
    assert second.path.endswith(f".{number + 2}.v2")
    with open(taken, "rb") as file:
        assert file.read() == b"not ours"


def test_writes_from_several_threads_lose_no_event(tmp_path):
    threads, per_thread = 8, 250
    start = threading.Barrier(threads)

    def write(writer, thread):
        start.wait()
        for i in range(per_thread):
            writer.write(thread * per_thread + i, [_events.scalar(f"t{thread}", float(i))])

    with _events.EventFileWriter(tmp_path) as writer:
        workers = [threading.Thread(target=write, args=(writer, t)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    events = records(writer.path)
    assert len(events) == 1 + threads * per_thread
    assert sorted(e.step for e in events[1:]) == list(range(threads * per_thread))
    for event in events[1:]:
        (value,) = event.summary.value
        thread, i = divmod(event.step, per_thread)
        assert (value.tag, tensor_util.make_ndarray(value.tensor).item()) == (f"t{thread}", float(i))


def test_writing_after_close_raises_naming_the_file(tmp_path):
    writer = _events.EventFileWriter(tmp_path)
    writer.close()
    writer.close()  # a second close does nothing
    with pytest.raises(ValueError, match=re.escape(f"{writer.path!r} is closed")):
        writer.write(1, [_events.scalar("a", 1.0)])
    with pytest.raises(ValueError, match="is closed"):
        writer.flush()


@pytest.mark.skipif(not os.path.exists("/dev/full") or not os.path.isdir("/proc/self/fd"), reason="Linux only")
def test_a_full_disk_raises_an_os_error_naming_the_file(tmp_path):
    writer = _events.EventFileWriter(tmp_path)
    # The disk fills up: the file's descriptor now writes to /dev/full (ENOSPC).
    (fd,) = [int(fd) for fd in os.listdir("/proc/self/fd") if _points_to(fd, writer.path)]
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)
    writer.write(1, [_events.scalar("a", 1.0)])  # buffered
    with pytest.raises(OSError) as raised:
        writer.flush()
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == writer.path
    assert writer.path in str(raised.value)
    with pytest.raises(OSError, match="No space left"):
        writer.close()


def _points_to(fd, path):
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == path
    except OSError:
        return False


def test_a_missing_directory_is_created_and_an_unusable_one_named(tmp_path):
    with _events.EventFileWriter(tmp_path / "a" / "b") as writer:
        pass
    assert os.path.dirname(writer.path) == str(tmp_path / "a" / "b")
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError) as raised:
        _events.EventFileWriter(tmp_path / "file" / "run")
    assert str(tmp_path / "file") in str(raised.value)


def test_a_remote_path_goes_through_tf_io_gfile(tmp_path):
    import tensorflow as tf

    with _events.EventFileWriter("ram://test_events/run") as writer:
        writer.write(3, [_events.scalar("a", 1.5)])
    assert writer.path.startswith("ram://test_events/run/events.out.tfevents.")
    assert tf.io.gfile.listdir("ram://test_events/run") == [os.path.basename(writer.path)]
    assert values(accumulator("ram://test_events/run"), "a") == [(3, 1.5)]


# Run in a fresh process where `import tensorflow` fails. The module file is
# loaded by path, under a name of its own: `import keras_safe_dist.report._events`
# would first run `keras_safe_dist/__init__.py`, which imports the package's
# exports (TensorFlow among them) unless the process is the command line.
# `_events` imports nothing from the package, so its file loads alone.
_WITHOUT_TENSORFLOW = """
import json, sys

attempts = []

class NoTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            attempts.append(name)
            raise ImportError(f"{name} is blocked by the test")
        return None

sys.meta_path.insert(0, NoTensorFlow())

import importlib.util

spec = importlib.util.spec_from_file_location("events_alone", sys.argv[1])
events = importlib.util.module_from_spec(spec)
spec.loader.exec_module(events)
with events.EventFileWriter(sys.argv[2]) as writer:
    writer.write(4, [events.scalar("loss", 0.75, description="the loss"), events.text("notes", "**ok**")])
imported = "tensorflow" in sys.modules
tried = list(attempts)
try:
    import tensorflow  # noqa: F401
    blocked = False
except ImportError:
    blocked = True
print(json.dumps({"imported": imported, "tried": tried, "blocked": blocked, "path": writer.path}))
"""


def test_writes_without_tensorflow(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TENSORFLOW, _events.__file__, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["blocked"]  # the blocker works
    assert result["tried"] == []  # nothing even tried to import TensorFlow
    assert not result["imported"]
    events = accumulator(tmp_path)
    assert values(events, "loss") == [(4, 0.75)]
    assert values(events, "notes") == [(4, b"**ok**")]
    assert events.SummaryMetadata("loss").summary_description == "the loss"
    assert os.path.dirname(result["path"]) == str(tmp_path)
