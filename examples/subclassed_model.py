"""A subclassed SafeDistributedModel on two replicas, checked against stock Keras.

`ResidualRegressor` subclasses `SafeDistributedModel` and implements `call()`
like any subclassed Keras model. It trains on two logical CPUs with
`gradient_accumulation_steps=3`, `global_clipnorm=1.0`, sample weights and an
uneven last micro-batch. A stock `keras.Model` with the same layers trains on
one device with one batch per update (3 micro-batches' samples) and the same
clipping on its optimizer; the script prints the largest relative difference
between the two sets of weights (float32 round-off), then saves and reloads
the subclassed model as `.keras` and compares predictions.

Run:
    PYTHONPATH=. python examples/subclassed_model.py
"""

import os
import tempfile

import numpy as np
from _quiet import import_tensorflow

tf = import_tensorflow()  # without its C++ start-up lines

# Two logical CPUs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402

MICRO_BATCH, STEPS = 16, 3


class ResidualBlock(keras.layers.Layer):
    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.inner = keras.layers.Dense(width, activation="tanh")
        self.outer = keras.layers.Dense(width)

    def call(self, x):
        return x + self.outer(self.inner(x))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def layers(width=16):
    keras.utils.set_random_seed(0)
    return [
        keras.layers.Dense(width, name="embed"),
        ResidualBlock(width, name="block"),
        keras.layers.Dense(1, name="head"),
    ]


@keras.saving.register_keras_serializable(package="examples")
class ResidualRegressor(SafeDistributedModel):
    def __init__(self, width=16, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.embed, self.block, self.head = layers(width)

    def call(self, x):
        return self.head(self.block(self.embed(x)))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def data(samples=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 8)).astype("float32")
    y = (np.sin(x[:, :1]) + x[:, 1:2] ** 2).astype("float32")
    weights = rng.uniform(0.5, 2.0, size=samples).astype("float32")
    return x, y, weights


def main():
    x, y, w = data()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        safe = ResidualRegressor(
            gradient_accumulation_steps=STEPS, global_clipnorm=1.0, log_update_stats=True
        )
        safe.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = safe.fit(x, y, sample_weight=w, batch_size=MICRO_BATCH, epochs=3, verbose=0, shuffle=False)
    print(f"replicas: {strategy.num_replicas_in_sync}, micro-batch {MICRO_BATCH}, accumulation {STEPS}")
    for epoch, loss in enumerate(history.history["loss"], start=1):
        print(f"epoch {epoch}: loss {loss:.5f}, last update {history.history['samples_per_update'][epoch - 1]:.0f} samples")

    stock_layers = layers()
    inputs = keras.Input((8,))
    h = inputs
    for layer in stock_layers:
        h = layer(h)
    stock = keras.Model(inputs, h)
    stock.compile(optimizer=keras.optimizers.SGD(0.05, global_clipnorm=1.0), loss="mse")
    stock.fit(x, y, sample_weight=w, batch_size=MICRO_BATCH * STEPS, epochs=3, verbose=0, shuffle=False)

    difference = max(
        np.linalg.norm(a - b) / np.linalg.norm(b)
        for a, b in zip(safe.get_weights(), stock.get_weights())
    )
    print(f"largest relative weight difference vs stock Keras on one device: {difference:.1e}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "regressor.keras")
        safe.save(path)
        loaded = keras.saving.load_model(path)
    same = np.allclose(loaded.predict(x, verbose=0), safe.predict(x, verbose=0), atol=1e-6)
    print(
        f"reloaded {type(loaded).__name__}: accumulation {loaded.gradient_accumulation_steps}, "
        f"global_clipnorm {loaded.global_clipnorm}, same predictions: {same}"
    )


if __name__ == "__main__":
    main()
