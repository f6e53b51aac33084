"""A stateless custom training loop on TensorFlow, audited before it trains.

The same convention as on JAX (Keras's JAX custom-loop guide): the state
`(trainable_variables, non_trainable_variables, optimizer_variables)` is
threaded through `train_step(state, data)`, a `tf.function`. The forward pass
is `model.stateless_call(..., training=True)` under a `tf.GradientTape` that
watches the trainable values. Keras's TensorFlow optimizers have no
`stateless_apply` (it raises "not supported with the TensorFlow backend"), so
`stateless_apply` below loads the state into the variables, applies the
optimizer and reads the variables back: the state stays the truth.
`keras_safe_dist.audit_train_step()` runs the step three times first, puts the
model's variables back as they were, and reports nothing for this loop.

Run:
    PYTHONPATH=. python examples/custom_loop_tf.py
"""

import numpy as np
from _quiet import import_tensorflow

tf = import_tensorflow()  # without its C++ start-up lines

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


def stateless_apply(optimizer, model, optimizer_variables, grads, trainable_variables):
    """`optimizer.stateless_apply` for TensorFlow: load, apply, read back."""
    targets = model.trainable_variables
    for variable, value in zip(targets, trainable_variables):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_variables):
        variable.assign(value)
    optimizer.apply(grads, targets)
    return (
        [tf.identity(v.value) for v in targets],
        [tf.identity(v.value) for v in optimizer.variables],
    )


def make_train_step(model, optimizer, loss_fn):
    """The stateless step: `train_step(state, data) -> (loss, state)`."""

    @tf.function
    def train_step(state, data):
        trainable_variables, non_trainable_variables, optimizer_variables = state
        x, y = data
        with tf.GradientTape() as tape:
            tape.watch(trainable_variables)
            y_pred, non_trainable_variables = model.stateless_call(
                trainable_variables, non_trainable_variables, x, training=True
            )
            loss = loss_fn(y, y_pred)
        grads = tape.gradient(loss, trainable_variables)
        trainable_variables, optimizer_variables = stateless_apply(
            optimizer, model, optimizer_variables, grads, trainable_variables
        )
        return loss, (trainable_variables, non_trainable_variables, optimizer_variables)

    return train_step


def main(samples=256, batch_size=32, epochs=3, log_dir=None):
    """Audits the step, trains, and writes the state back into the model.

    Returns:
        `(report, losses, model)`: the audit's `AuditReport`, the mean loss of
        each epoch and the trained model.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")

    keras.utils.set_random_seed(0)
    model = build_model()
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
    train_step = make_train_step(model, optimizer, keras.losses.MeanSquaredError())

    first = (tf.constant(x[:batch_size]), tf.constant(y[:batch_size]))
    report = keras_safe_dist.audit_train_step(train_step, model, optimizer, first, log_dir=log_dir)
    print(report.summary())

    state = (
        [tf.identity(v.value) for v in model.trainable_variables],
        [tf.identity(v.value) for v in model.non_trainable_variables],
        [tf.identity(v.value) for v in optimizer.variables],
    )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=True)
    losses = []
    for epoch in range(epochs):
        epoch_losses = []
        for batch in dataset:
            loss, state = train_step(state, batch)
            epoch_losses.append(float(loss))
        losses.append(float(np.mean(epoch_losses)))
        print(f"epoch {epoch + 1}: loss {losses[-1]:.4f}")

    variables = model.trainable_variables + model.non_trainable_variables + optimizer.variables
    for variable, value in zip(variables, [v for values in state for v in values]):
        variable.assign(value)
    return report, losses, model


if __name__ == "__main__":
    main()
