"""`jit_compile=True` on several replicas: each replica's pass compiled with XLA.

Stock Keras compiles the whole train step, which under MirroredStrategy reads
another replica's variables from the wrong device (tensorflow#53140) and
cannot hold the cross-replica update. Here each replica calls one XLA
function that receives its variables' *values* as arguments (so it captures
no distributed variable) and runs the forward pass, the compiled loss and the
backward pass under a `keras.StatelessScope`. The all-reduce, the update, the
write-back of the state the pass changed (BatchNormalization statistics, seed
generators, per-output loss trackers) and the metrics stay outside XLA.
"""

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist.update import _loss


def check_model(model):
    """Raises ValueError for layers whose forward pass synchronizes replicas."""
    synced = [
        layer.name
        for layer in _compat.flatten_layers(model)
        if getattr(layer, "synchronized", False) is True
    ]
    if synced:
        raise ValueError(
            "SafeDistributedModel compiles each replica's pass with XLA on "
            "several replicas, and a layer that synchronizes the replicas in "
            "its forward pass cannot run inside it. Received: "
            f"synchronized layers {synced} with jit_compile=True. Use "
            "jit_compile=False, or synchronized=False."
        )


def replica_step(model, data):
    """Replica context: the train step with the replica's pass compiled by XLA.

    Returns the step's logs, as `SafeDistributedModel._step` does.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    engine = model._update_engine
    trainable = list(model.trainable_variables)
    stateful = list(model.non_trainable_variables)
    compiled = _compat.compile_loss(model)
    if compiled is not None:
        stateful += list(compiled.variables)
    loss_scale = engine.loss_scale
    # Inside XLA the objective is divided by an estimate of the update's
    # denominator (exact for even shares); the all-reduced denominator
    # corrects the gradients outside.
    divide = engine.steps == 1 or engine.estimates
    changed = []  # set while tracing: which of `stateful` the pass assigned
    per_sample = []  # set while tracing: the loss's `per_sample` (a Python bool)

    def replica_pass(trainable_values, state_values, x, y, sample_weight, scale):
        mapping = list(zip(trainable, trainable_values)) + list(zip(stateful, state_values))
        with tf.GradientTape() as tape:
            tape.watch(trainable_values)
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                before = [scope.get_current_value(v) for v in stateful]
                y_pred, keep = model._forward(x, training=True)
                micro = _loss.kept(
                    _loss.micro_batch_loss(model, y, y_pred, sample_weight), keep
                )
            estimate = (
                engine.denominator_estimate(micro)
                if divide
                else tf.ones((), micro.numerator.dtype)
            )
            objective = micro.numerator / estimate
            if scale is not None:
                objective = objective * tf.cast(scale, objective.dtype)
        grads = tape.gradient(objective, trainable_values)
        per_sample[:] = [micro.per_sample]
        micro = micro._replace(per_sample=True)  # not a tensor to return
        after = [scope.get_current_value(v) for v in stateful]
        changed[:] = [i for i, (b, a) in enumerate(zip(before, after)) if a is not b]
        masks = [_compat.keras_mask(t) for t in keras.tree.flatten(y_pred)]
        return micro, estimate, grads, [after[i] for i in changed], y_pred, masks

    def values(variables):
        # In replica context a distributed variable reads as this replica's copy.
        return [tf.convert_to_tensor(v.value) for v in variables]

    scale = None if loss_scale is None else tf.convert_to_tensor(loss_scale.dynamic_scale)
    compiled_pass = tf.function(replica_pass, jit_compile=True, autograph=False)
    micro, estimate, grads, new_state, y_pred, masks = compiled_pass(
        values(trainable), values(stateful), x, y, sample_weight, scale
    )
    micro = micro._replace(per_sample=per_sample[0])
    for i, value in zip(changed, new_state):
        stateful[i].assign(value)
    for t, mask in zip(keras.tree.flatten(y_pred), masks):
        if mask is not None:
            _compat.set_keras_mask(t, mask)
    # The penalty at the weights the micro-batch ran with, before the update.
    penalty = _loss.weight_regularization(model)
    model._track_loss(engine.after_estimated_micro_batch(grads, micro, estimate), penalty)
    return model._step_logs(x, y, y_pred, sample_weight)
