"""Probe: the optimizer's own `gradient_accumulation_steps` under MirroredStrategy.

Stock Keras applies the accumulated gradients inside a `tf.cond` in replica
context; the optimizer's cross-replica `merge_call` cannot run there, so
`fit` crashes while tracing the step. SafeDistributedModel decides in
cross-replica context. Crash or not: the figure is the number of optimizer
updates applied by one epoch (2 micro-batches per update), or the error.
"""

import keras

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]

STEPS = 2
GROUPS = 2


def run(strategy):
    replicas = strategy.num_replicas_in_sync
    micro_batch = 2 * replicas
    x, y = _tiny.data(micro_batch * STEPS * GROUPS)

    def stock():
        model = _tiny.mlp(
            keras.Model, strategy,
            optimizer=lambda: _tiny.sgd(gradient_accumulation_steps=STEPS),
        )
        _tiny.update(model, strategy, x, y, micro_batch)
        return _updates(model, GROUPS)

    def safe():
        model = _tiny.mlp(SafeDistributedModel, strategy, gradient_accumulation_steps=STEPS)
        _tiny.update(model, strategy, x, y, micro_batch)
        return _updates(model, GROUPS)

    return measure(stock), measure(safe)


def _updates(model, expected):
    iterations = int(model.optimizer.iterations.numpy())
    return Side(iterations == expected, iterations)


PROBE = Probe(
    name="optimizer-accumulation",
    checks=(
        f"SGD(gradient_accumulation_steps={STEPS}) fit under MirroredStrategy: "
        "crash or not (figure: optimizer iterations after one epoch)"
    ),
    run=run,
)
