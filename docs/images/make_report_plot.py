"""Draws docs/images/report_plot.png, the README's picture of a run: its statistics and NaN onset.

A real run: two logical CPUs stand in for two devices under MirroredStrategy;
a small classifier trains 12 epochs on a stream of synthetic samples (each
epoch reads new ones) with gradient accumulation and clipping, watched by a
Dashboard, Keras's TensorBoard callback and a NaNOnsetDetector that lets
training go on (`action="continue"`: the update is skipped). One sample read
in epoch 6 holds a NaN, as a corrupted record would. Then
`keras-safe-dist report LOGDIR --plot FILE` prints the report and draws the
picture. The log directory stays, for TensorBoard (`tensorboard --logdir DIR`).

Needs the [tensorflow] and [plot] extras. Run, from the repository's root
(about 20 s on 2 CPU cores):
    PYTHONPATH=. python3 docs/images/make_report_plot.py [--log-dir DIR] [--out FILE]
"""

import argparse
import os
import shutil

import numpy as np

# TensorFlow's C++ start-up lines go to file descriptor 2 before any log level
# applies: it points at /dev/null while TensorFlow loads and its devices start.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
_STDERR, _NULL = os.dup(2), os.open(os.devnull, os.O_WRONLY)
os.dup2(_NULL, 2)
try:
    import tensorflow as tf

    # Two logical CPUs; must precede any other TF use.
    _CPU = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.list_logical_devices("CPU")
finally:
    os.dup2(_STDERR, 2)
    os.close(_NULL)
    os.close(_STDERR)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist import callbacks  # noqa: E402
from keras_safe_dist import cli  # noqa: E402

EPOCHS = 12
BATCHES = 12  # per epoch, of BATCH_SIZE samples; an update every 2
BATCH_SIZE = 64
POISONED = (6, 7)  # (epoch, batch) holding the sample with a NaN
HERE = os.path.dirname(os.path.abspath(__file__))


def stream(features=16, classes=4, seed=0):
    """Every epoch's batches in one pass: EPOCHS x BATCHES batches of new samples."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=1.2, size=(classes, features))
    samples = EPOCHS * BATCHES * BATCH_SIZE
    y = rng.integers(0, classes, size=samples)
    x = (centers[y] + rng.normal(size=(samples, features))).astype("float32")
    epoch, batch = POISONED
    x[(epoch * BATCHES + batch) * BATCH_SIZE + 5, 3] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, y.astype("int32"))).batch(BATCH_SIZE)


def train(log_dir):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        h = keras.layers.Dense(64, activation="relu")(inputs)
        h = keras.layers.Dense(64, activation="relu")(h)
        model = SafeDistributedModel(
            inputs, keras.layers.Dense(4)(h), gradient_accumulation_steps=2, global_clipnorm=1.0
        )
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    watchers = [
        callbacks.NaNOnsetDetector(log_dir=log_dir, action="continue"),
        callbacks.Dashboard(log_dir),
        keras.callbacks.TensorBoard(log_dir),
    ]
    model.fit(stream(), steps_per_epoch=BATCHES, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=watchers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-dir", default=os.path.join("logs", "report_plot"),
        help="the run's log directory, emptied first (default logs/report_plot)",
    )
    parser.add_argument(
        "--out", default=os.path.relpath(os.path.join(HERE, "report_plot.png")),
        help="the picture (default docs/images/report_plot.png)",
    )
    args = parser.parse_args()
    shutil.rmtree(args.log_dir, ignore_errors=True)
    train(args.log_dir)
    print()
    return cli.main(["report", args.log_dir, "--plot", args.out])


if __name__ == "__main__":
    code = main()
    # The run's NaN onset fails the report (exit 1): that is the picture's point.
    raise SystemExit(0 if code == 1 else code)
