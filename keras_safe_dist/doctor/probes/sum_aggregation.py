"""Probe: a layer variable with `aggregation="sum"` written on every step.

A layer that counts steps with `assign_add(1.0)` on a variable with
`aggregation="sum"` and the default (on-write) synchronization does not add
the replicas' increments under MirroredStrategy: Keras assigns the new value,
so each step sums the replicas' new values, and the variable grows
exponentially (2, 6, 14, 30 on two replicas) instead of by `replicas` per
step. This mechanism caused the Keras 3.7-3.9 NaN and is still live for
custom layers. SafeDistributedModel cannot change how a layer writes its own
variables; its side is what `keras_safe_dist.audit` reports for the
variable: finding AGG003 ("on-write variable with sum aggregation", the
finding that names this mechanism) for it is correct. The safe figure says
so in words: `audit reports AGG003 (on-write variable with sum aggregation)
for step_counter/count`.
"""

import keras
import numpy as np

import keras_safe_dist
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.findings import CODES

__all__ = ["PROBE"]

STEPS = 4
CODE = "AGG003"
# What the audit's finding says, from the registered codes.
FINDING = f"{CODE} ({CODES[CODE].title})"


class StepCounter(keras.layers.Layer):
    """Passes its input through and adds 1.0 to `count` per training call."""

    def build(self, input_shape):
        self.count = self.add_weight(
            shape=(), initializer="zeros", trainable=False, aggregation="sum", name="count"
        )

    def call(self, inputs, training=False):
        if training:
            self.count.assign_add(1.0)
        return inputs


def build(strategy):
    with strategy.scope():
        inputs = keras.Input((4,))
        counter = StepCounter(name="step_counter")
        outputs = keras.layers.Dense(1)(counter(inputs))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=_tiny.sgd(), loss="mse")
    return model, counter.count


def run(strategy):
    replicas = strategy.num_replicas_in_sync

    def stock():
        model, count = build(strategy)
        x = np.ones((STEPS * replicas, 4), "float32")
        _tiny.update(model, strategy, x, x[:, :1], replicas)
        value = float(count.numpy())
        # Summing the increments gives `replicas` per step.
        return Side(value == STEPS * replicas, value)

    def safe():
        model, count = build(strategy)
        report = keras_safe_dist.audit(model, strategy=None)
        found = [f for f in report.findings if f.code == CODE and count.path in f.subject]
        if found:
            return Side(True, f"audit reports {FINDING} for {found[0].subject}")
        codes = sorted({f.code for f in report.findings}) or ["none"]
        return Side(
            False,
            f"audit reports no {FINDING} for {count.path} (its findings: {', '.join(codes)})",
        )

    return measure(stock), measure(safe)


PROBE = Probe(
    name="sum-aggregation",
    checks=(
        f"layer variable, aggregation='sum', assign_add(1.0) per step: value after "
        f"{STEPS} steps (replicas x {STEPS} is correct). SafeDistributedModel cannot "
        "change how a layer writes its own variables: its side passes when "
        f"keras_safe_dist.audit(model) reports {FINDING} for that variable"
    ),
    run=run,
)
