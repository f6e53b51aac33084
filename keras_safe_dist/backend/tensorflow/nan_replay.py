"""Replays one captured batch eagerly, checking every layer's output.

`NaNOnsetDetector` calls `replay` once, after the in-graph probe fired, on the
share of the batch that the firing replica saw. Each layer's `call` is wrapped
for the duration of the replay (functional and subclassed models alike, nested
layers included); a layer is recorded when its call returns. The first layer
in that order whose output is non-finite although its floating inputs are
finite is the layer that produced the non-finite value. Gradients of the
loss are computed in the same pass to name the variables whose gradient is
non-finite. The replay runs in training mode, as the step did; state it changes
(non-trainable variables such as BatchNormalization statistics, and metrics)
is put back afterwards.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_safe_dist.backend.tensorflow import nan_probe as _nan_probe
from keras_safe_dist.nan.replay import Replay
from keras_safe_dist.nan.replay import wrapped_calls
from keras_safe_dist.update import _loss

__all__ = ["replay"]


def replay(model, x, y, sample_weight):
    """Replays `(x, y, sample_weight)` through `model` once; returns a `Replay`.

    Under a `MirroredStrategy` every replica runs the same share (distributed
    variables can only be differentiated in replica context); replica 0's
    records are used. Not supported under `MultiWorkerMirroredStrategy`, where
    a layer that updates state would wait for the other workers.
    """
    strategy = model.distribute_strategy
    records = {}

    def forward_backward(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = _loss.micro_batch_loss(model, y, y_pred, sample_weight).numerator
        return loss, tape.gradient(loss, model.trainable_weights)

    saved = [(v, np.array(v.numpy())) for v in _state_variables(model)]
    try:
        with strategy.scope(), wrapped_calls(model, records, _recording), _quiet_tensorflow():
            loss, grads = strategy.run(forward_backward, args=(x, y, sample_weight))
        loss = strategy.experimental_local_results(loss)[0]
        grads = [None if g is None else strategy.experimental_local_results(g)[0] for g in grads]
    except Exception as error:  # noqa: BLE001 - a failed replay must not end training
        return Replay(None, None, None, (), f"{type(error).__name__}: {error}")
    finally:
        with strategy.scope():
            for variable, value in saved:
                variable.assign(value)
    records = records.get(0, [])
    layer = next((name for name, inputs_ok, output_ok in records if inputs_ok and not output_ok), None)
    first = next((name for name, _, output_ok in records if not output_ok), None)
    bad_grads = tuple(
        v.path
        for v, g in zip(model.trainable_weights, grads)
        if g is not None and bool(_nan_probe.tensor_nonfinite(g))
    )
    return Replay(layer, first, bool(_finite(loss)), bad_grads, None)


@contextlib.contextmanager
def _quiet_tensorflow():
    # Running a MirroredStrategy eagerly logs a performance warning; the
    # replay runs once.
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _recording(layer, call, records):
    def recorded_call(*args, **kwargs):
        outputs = call(*args, **kwargs)
        replica = tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group
        )
        records.setdefault(int(replica or 0), []).append(
            (layer.name, _finite((args, kwargs)), _finite(outputs))
        )
        return outputs

    return recorded_call


def _finite(structure):
    for value in keras.tree.flatten(structure):
        if isinstance(value, (tf.Tensor, tf.Variable, keras.Variable, np.ndarray)):
            tensor = tf.convert_to_tensor(value)
            if tensor.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(tensor))):
                return False
    return True


def _state_variables(model):
    return list(model.non_trainable_variables) + list(model.metrics_variables)
