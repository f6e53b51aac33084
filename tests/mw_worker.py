"""A worker of the multi-worker tests (run through keras_safe_dist.scale_out.launch).

Trains a small SafeDistributedModel under MultiWorkerMirroredStrategy on NumPy
arrays and on a tf.data dataset, and prints `RESULT <json>` with the weights
and logs of each.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

# The strategy must exist before any other TensorFlow op.
STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist import callbacks as safe_callbacks  # noqa: E402
from keras_safe_dist import is_chief  # noqa: E402
from keras_safe_dist.callbacks import MultiWorkerBackupAndRestore  # noqa: E402

SAMPLES, BATCH = 45, 10


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + 0.1).astype("float32")
    return x, y


def build(steps, clipnorm, execution=1):
    with STRATEGY.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3, activation="tanh")(inputs)
        model = SafeDistributedModel(
            inputs, keras.layers.Dense(1)(hidden),
            gradient_accumulation_steps=steps, global_clipnorm=clipnorm,
            log_update_stats=True,
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=execution)
    return model


class Progress(keras.callbacks.Callback):
    """Prints each batch and epoch end, slowly enough to be interrupted."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"BATCH {self.epoch} {batch}", flush=True)
        time.sleep(self.delay)

    def on_epoch_end(self, epoch, logs=None):
        print(f"EPOCH_END {epoch}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--clipnorm", type=float, default=None)
    parser.add_argument("--execution", type=int, default=1, help="steps_per_execution")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backup", default=None)
    parser.add_argument("--inputs", default="numpy,dataset")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--log-dir", default=None, help="one log directory shared by all workers")
    parser.add_argument("--nan-row", type=int, default=None, help="a row of x made NaN")
    args = parser.parse_args()
    x, y = data()
    if args.nan_row is not None:
        x[args.nan_row, 0] = np.nan
    results = {"chief": is_chief(STRATEGY)}
    for inputs in args.inputs.split(","):
        model = build(args.steps, args.clipnorm, args.execution)
        callbacks = [Progress(args.delay)]
        if args.backup:
            callbacks.insert(0, MultiWorkerBackupAndRestore(args.backup))
        audits = []
        if args.log_dir:
            log_dir = os.path.join(args.log_dir, inputs)
            audits = [
                safe_callbacks.ScopeAudit(log_dir=log_dir),
                safe_callbacks.AggregationAudit(log_dir=log_dir),
                safe_callbacks.TrainingModeAudit(log_dir=log_dir),
            ]
            callbacks += audits + [safe_callbacks.Dashboard(log_dir)]
        detector = None
        if args.nan_row is not None:
            detector = safe_callbacks.NaNOnsetDetector(log_dir=args.log_dir)
            callbacks.append(detector)
        if inputs == "numpy":
            history = model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks)
        else:
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
            history = model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks)
        results[inputs] = {
            "weights": [w.tolist() for w in model.get_weights()],
            "history": history.history,
            "iterations": int(model.optimizer.iterations.numpy()),
            "audits": [audit.report.summary() for audit in audits],
            "pid": os.getpid(),
            "nan_onset": None if detector is None or detector.report is None else {
                name: detector.report[name]
                for name in ("epoch", "batch", "kind", "replicas", "layer", "notes", "files")
            },
        }
    print("RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
