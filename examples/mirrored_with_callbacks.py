"""MirroredStrategy training with every keras_safe_dist callback, then its report.

Two logical CPUs stand in for two devices. A small classifier with
BatchNormalization and Dropout trains on synthetic data with gradient
accumulation and clipping, watched by the audits (scope, aggregation,
training mode), the NaN onset detector and the Dashboard, all writing into one
log directory next to
Keras's own TensorBoard callback. At the end the script prints what
`keras-safe-dist report LOGDIR` prints, and the command to open TensorBoard.

Run:
    PYTHONPATH=. python examples/mirrored_with_callbacks.py [--log-dir DIR]
"""

import argparse
import os

import numpy as np
from _quiet import import_tensorflow

tf = import_tensorflow()  # without its C++ start-up lines

# Two logical CPUs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist import callbacks  # noqa: E402
from keras_safe_dist.report import format_text  # noqa: E402
from keras_safe_dist.report import read_log_dir  # noqa: E402


def data(samples=1200, features=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=2.0, size=(classes, features))
    y = rng.integers(0, classes, size=samples)
    x = centers[y] + rng.normal(size=(samples, features))
    return x.astype("float32"), y.astype("int32")


def main(log_dir):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = data()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((x.shape[1],))
        h = keras.layers.Dense(64, activation="relu")(inputs)
        h = keras.layers.BatchNormalization(synchronized=True)(h)
        h = keras.layers.Dropout(0.2)(h)
        outputs = keras.layers.Dense(4)(h)
        model = SafeDistributedModel(
            inputs, outputs, gradient_accumulation_steps=2, global_clipnorm=1.0
        )
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    watchers = [
        callbacks.ScopeAudit(log_dir=log_dir),
        callbacks.AggregationAudit(log_dir=log_dir),
        callbacks.TrainingModeAudit(log_dir=log_dir),
        callbacks.NaNOnsetDetector(log_dir=log_dir),
        callbacks.Dashboard(log_dir),
        keras.callbacks.TensorBoard(log_dir),
    ]
    history = model.fit(
        x, y, batch_size=64, epochs=4, validation_split=0.2, verbose=0, callbacks=watchers
    )
    for epoch, (loss, accuracy) in enumerate(
        zip(history.history["loss"], history.history["val_accuracy"]), start=1
    ):
        print(f"epoch {epoch}: loss {loss:.4f}, validation accuracy {accuracy:.3f}")
    for audit in watchers[:3]:
        print(audit.report.summary())
    print()
    print(format_text(read_log_dir(log_dir)))
    print(f"\nOpen the dashboard with: tensorboard --logdir {log_dir}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-dir",
        default=os.path.join("logs", "mirrored_with_callbacks"),
        help="where to write the logs, kept for TensorBoard (default: logs/mirrored_with_callbacks)",
    )
    main(parser.parse_args().log_dir)
