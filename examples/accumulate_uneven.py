"""Gradient accumulation with clipping over an uneven dataset on two replicas.

Two logical CPUs stand in for two devices under `MirroredStrategy`. With 1000
samples and `batch_size=64` (the global micro-batch, 32 per replica), an epoch
has 16 micro-batches, the last one holding only 40 samples. With
`gradient_accumulation_steps=3` the model makes 5 updates of 192 samples and a
sixth, partial update of the last 40 samples, weighted by its samples rather
than as a third of a group. Each update clips the all-reduced gradient to a
global norm of 1.0, so every replica applies the same clipped update.

The logs show the loss, the global norm of the last update's gradient (before
clipping), the fraction of the epoch's updates that were clipped, the updates
skipped for non-finite gradients, and the samples behind the last update (40).
As the loss falls, fewer updates need clipping and `clip_rate` drops to 0.

Run:
    PYTHONPATH=. python examples/accumulate_uneven.py
"""

import numpy as np
from _quiet import import_tensorflow

tf = import_tensorflow()  # without its C++ start-up lines

# Two logical CPUs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402

LOGGED = ("loss", "grad_norm", "clip_rate", "skipped_updates", "samples_per_update")


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1)) * 0.5).astype("float32")

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        outputs = keras.layers.Dense(1)(hidden)
        model = SafeDistributedModel(
            inputs=inputs,
            outputs=outputs,
            gradient_accumulation_steps=3,
            global_clipnorm=1.0,
            log_update_stats=True,
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

    history = model.fit(x, y, batch_size=64, epochs=5, verbose=0)

    print(
        f"replicas: {strategy.num_replicas_in_sync}, micro-batches per epoch: 16, "
        "updates per epoch: 6 (5 x 192 samples + 1 x 40)"
    )
    print(f"{'epoch':>5}" + "".join(f"{name:>19}" for name in LOGGED))
    for epoch in history.epoch:
        values = "".join(f"{history.history[name][epoch]:>19.4f}" for name in LOGGED)
        print(f"{epoch + 1:>5}{values}")


if __name__ == "__main__":
    main()
