"""Reports written into a log directory read back in the order they were written."""

import os

import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from keras_safe_dist.report import writer


def test_writes_to_one_log_dir_share_one_event_file_in_step_order(tmp_path):
    log_dir = str(tmp_path)
    for step in range(5):
        writer.write_scalars(log_dir, {"audits/x/error": float(step)}, step=step)
    files = [name for name in os.listdir(log_dir) if name.startswith("events.out.tfevents")]
    assert len(files) == 1
    # TensorBoard's default reader drops steps that go back: all must survive.
    events = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    events.Reload()
    written = [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors("audits/x/error")]
    assert written == [(step, float(step)) for step in range(5)]


def test_a_removed_log_dir_is_written_again(tmp_path):
    log_dir = str(tmp_path / "run")
    writer.write_scalars(log_dir, {"a": 1.0}, step=0)
    for name in os.listdir(log_dir):
        os.remove(os.path.join(log_dir, name))
    os.rmdir(log_dir)
    writer.write_scalars(log_dir, {"a": 2.0}, step=1)
    events = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("a")] == [1]


def test_a_removed_event_file_is_written_again_in_the_same_directory(tmp_path):
    log_dir = str(tmp_path)
    writer.write_text(log_dir, "notes", "first", step=0)
    (first,) = os.listdir(log_dir)
    os.remove(os.path.join(log_dir, first))
    writer.write_text(log_dir, "notes", "second", step=1)
    writer.write_scalars(log_dir, {"a": 3.0}, step=2)
    (second,) = os.listdir(log_dir)
    assert second != first
    events = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, tf.make_ndarray(e.tensor_proto).item()) for e in events.Tensors("notes")] == [(1, b"second")]
    assert [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors("a")] == [(2, 3.0)]
