"""A custom training loop on JAX with DataParallel, audited before it trains.

The loop of Keras's JAX guides ("Writing a training loop from scratch in JAX",
"Multi-GPU distributed training with JAX"), written with the Keras
distribution API: the state `(trainable_variables, non_trainable_variables,
optimizer_variables)` is threaded through a jitted `train_step`, the forward
pass runs with `training=True`, and each batch is split across the devices
with the distribution's data layout. `keras_safe_dist.audit_train_step()`
runs the step three times on a copy of the state first and reports nothing
for this loop; docs/custom_loops.md shows what it reports for broken ones.

Two CPU devices stand in for two accelerators when run as a script.

Run:
    PYTHONPATH=. python examples/custom_loop_jax.py
"""

import os
import random

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np  # noqa: E402
from _extras import require  # noqa: E402

jax = require("jax")  # or exit naming the [jax] extra and its install command

import keras  # noqa: E402

import keras_safe_dist  # noqa: E402

FEATURES = 8


def build_model():
    """A small regression model with the layers that depend on `training`."""
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    hidden = keras.layers.BatchNormalization(name="batch_norm")(hidden)
    hidden = keras.layers.Dropout(0.2, name="dropout")(hidden)
    outputs = keras.layers.Dense(1, name="output")(hidden)
    return keras.Model(inputs, outputs)


def make_train_step(model, optimizer, loss_fn):
    """The jitted stateless step: `train_step(state, data) -> (loss, state)`."""

    def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True
        )
        return loss_fn(y, y_pred), non_trainable_variables

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        trainable_variables, non_trainable_variables, optimizer_variables = state
        x, y = data
        (loss, non_trainable_variables), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y
        )
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return loss, (trainable_variables, non_trainable_variables, optimizer_variables)

    return train_step


def shard(batch, distribution):
    """Each array of `batch` split along its first axis across the devices."""
    return tuple(
        keras.distribution.distribute_tensor(a, distribution.get_data_layout(a.shape))
        for a in batch
    )


def main(samples=256, batch_size=32, epochs=3, devices=None, log_dir=None):
    """Audits the step, trains, and writes the state back into the model.

    Returns:
        `(report, losses, model)`: the audit's `AuditReport`, the mean loss of
        each epoch and the trained model.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")

    distribution = keras.distribution.DataParallel(devices=devices or jax.devices())
    with distribution.scope():  # the model's and optimizer's variables are replicated
        random.seed(0)  # the initializers' seeds (keras.utils.set_random_seed imports TensorFlow)
        model = build_model()
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
        train_step = make_train_step(model, optimizer, keras.losses.MeanSquaredError())

        first = shard((x[:batch_size], y[:batch_size]), distribution)
        report = keras_safe_dist.audit_train_step(
            train_step, model, optimizer, first, log_dir=log_dir
        )
        print(report.summary())

        state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
        losses = []
        for epoch in range(epochs):
            epoch_losses = []
            for start in range(0, samples - batch_size + 1, batch_size):
                batch = shard((x[start:start + batch_size], y[start:start + batch_size]), distribution)
                loss, state = train_step(state, batch)
                epoch_losses.append(float(loss))
            losses.append(float(np.mean(epoch_losses)))
            print(f"epoch {epoch + 1}: loss {losses[-1]:.4f}")

        # The loop's state is the truth; the model holds it again only when told.
        variables = model.trainable_variables + model.non_trainable_variables + optimizer.variables
        for variable, value in zip(variables, [v for values in state for v in values]):
            variable.assign(value)
    return report, losses, model


if __name__ == "__main__":
    main()
