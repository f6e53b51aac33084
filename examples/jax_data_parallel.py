"""A JAX user's whole flow: keras.distribution, SafeDistributedModel, every callback, the report.

Two CPU devices stand in for two accelerators under Keras's JAX backend and
`keras.distribution.DataParallel`: each batch is sharded across them and XLA
reduces the gradient inside the compiled step. The model accumulates two
micro-batches of 64 per update and clips the update's global norm to 1.0.
With 1000 samples an epoch has 16 micro-batches, the last holding 40 samples
(placed whole on each device when they cannot split it evenly), so the eighth
update of each epoch sums 104 samples (64 + 40) and weighs each sample as the
other updates do. The callbacks write into one log directory, which
`keras-safe-dist report` then reads back.

Run:
    PYTHONPATH=. python examples/jax_data_parallel.py
"""

import argparse
import os
import random
import subprocess
import sys

# The backend and the device count are fixed when keras and jax are imported.
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import numpy as np  # noqa: E402
from _extras import require  # noqa: E402

jax = require("jax")  # or exit naming the [jax] extra and its install command

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist import callbacks  # noqa: E402


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1)) * 0.5).astype("float32")
    return x, y


def main(log_dir):
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    random.seed(0)  # Keras's initializers draw their seeds here; keras.utils.set_random_seed
    # would import TensorFlow where it is installed, to seed it too
    x, y = data()
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.1)(h)
    model = SafeDistributedModel(
        inputs,
        keras.layers.Dense(1)(h),
        gradient_accumulation_steps=2,
        global_clipnorm=1.0,
    )
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse")
    watchers = [
        callbacks.ScopeAudit(log_dir=log_dir),
        callbacks.AggregationAudit(log_dir=log_dir),
        callbacks.TrainingModeAudit(log_dir=log_dir),
        callbacks.NaNOnsetDetector(log_dir=log_dir),
        callbacks.Dashboard(log_dir),
    ]
    history = model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=watchers)
    print(f"devices: {len(jax.devices())}, micro-batches per epoch: 16, updates per epoch: 8")
    for epoch in range(3):
        logs = {k: v[epoch] for k, v in history.history.items()}
        print(
            f"epoch {epoch + 1}: loss {logs['loss']:.4f}, grad_norm {logs['grad_norm']:.3f}, "
            f"clip_rate {logs['clip_rate']:.3f}, last update {logs['samples_per_update']:.0f} samples"
        )
    for audit in watchers[:3]:
        print(audit.report.summary())
    print(f"NaN onset: {'none' if watchers[3].report is None else watchers[3].report['summary']}")
    report = subprocess.run(
        [sys.executable, "-m", "keras_safe_dist", "report", log_dir],
        capture_output=True,
        text=True,
        check=False,
    )
    print(f"\n$ keras-safe-dist report {log_dir}  (exit status {report.returncode})")
    print(report.stdout.rstrip())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-dir",
        default=os.path.join("logs", "jax_data_parallel"),
        help="where to write the logs (default: logs/jax_data_parallel)",
    )
    main(parser.parse_args().log_dir)
