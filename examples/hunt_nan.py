"""Hunting a NaN that appears on one replica, in one layer, on one batch.

Two logical CPUs stand in for two devices under `MirroredStrategy`. The model
starts with a `SafeLog` layer that computes `log(1 + x)` on its inputs, which
is fine for this data (features in [0, 1]) except for one sample of batch 9,
whose feature is -2: `log(-1)` is NaN, from a finite input. The sample sits in the second replica's half of the
batch, so only that replica sees the NaN; its loss and gradients turn NaN, the
reduced update is non-finite and skipped.

`NaNOnsetDetector(action="restore")` notices it from the step's logs, replays
that replica's share of the batch once with every layer's output checked,
names the layer, puts back the weights from before the batch and stops. It
writes `nan_onset.json`, `nan_onset_batch.npz` and a TensorBoard text summary
into the log directory (`logs/hunt_nan` unless `--log-dir` says otherwise) and
prints one paragraph; this script then prints the report's fields.

Run:
    python examples/hunt_nan.py [--log-dir DIR]
"""

import argparse
import json
import os

import numpy as np
from _quiet import import_tensorflow

tf = import_tensorflow()  # without its C++ start-up lines

# Two logical CPUs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist.callbacks import NaNOnsetDetector  # noqa: E402

BATCH = 32
FIELDS = ("epoch", "batch", "kind", "layer", "replica", "variables", "restored_to")


class SafeLog(keras.layers.Layer):
    """log(1 + x), elementwise: NaN for x < -1."""

    def call(self, inputs):
        return tf.math.log(1.0 + inputs)


def main(log_dir):
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, size=(640, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    x[9 * BATCH + 20, 3] = -2.0  # batch 9, row 20: the second replica's half

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = SafeLog(name="safe_log")(inputs)
        hidden = keras.layers.Dense(16, activation="relu", name="encoder")(hidden)
        outputs = keras.layers.Dense(1, name="head")(hidden)
        model = SafeDistributedModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")

    detector = NaNOnsetDetector(log_dir=log_dir, action="restore", history=5)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[detector])

    report = detector.report
    print()
    for field in FIELDS:
        print(f"{field}: {report[field]}")
    print("history (epoch, batch, loss):", [
        (h["epoch"], h["batch"], round(h["loss"], 4)) for h in report["history"]
    ])
    print("files:", sorted(f for f in os.listdir(log_dir) if f.startswith("nan_onset")))
    with open(os.path.join(log_dir, "nan_onset.json")) as f:
        saved = json.load(f)
    print("finding:", saved["finding"]["code"], saved["finding"]["subject"])
    finite = all(np.isfinite(w).all() for w in model.get_weights())
    print("weights finite after restore:", finite)
    print(f"report files in {log_dir}; keras-safe-dist report {log_dir} reads them")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "hunt_nan"), help="default: logs/hunt_nan")
    main(parser.parse_args().log_dir)
