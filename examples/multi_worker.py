"""Data-parallel training across processes with MultiWorkerMirroredStrategy.

Run it directly and it starts two local workers on 127.0.0.1 through
`keras_safe_dist.scale_out.launch` (the same as `keras-safe-dist launch --workers 2
examples/multi_worker.py`). Each worker reads its `TF_CONFIG`, creates the
strategy before any other TensorFlow op, and trains the same
`SafeDistributedModel` with gradient accumulation and clipping; both end with
identical weights, equal to one device training on one batch per update.
Only the chief (worker 0) prints the summary and writes the backup.

On a real cluster, set `TF_CONFIG` on each machine yourself (see
docs/scaling_out.md) and run this script once per machine.

Run:
    python examples/multi_worker.py
"""

import os
import sys

from _quiet import import_tensorflow
from _quiet import native_stderr_silenced

# Without its C++ start-up lines; first, since importing keras_safe_dist loads
# TensorFlow too (in the launching process as well).
tf = import_tensorflow()

if "TF_CONFIG" not in os.environ:
    from keras_safe_dist.scale_out.launch import launch

    sys.exit(launch(__file__, workers=2, timeout=300))

with native_stderr_silenced():  # TensorFlow 2.18 starts its C++ logging here
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist import is_chief  # noqa: E402
from keras_safe_dist.callbacks import MultiWorkerBackupAndRestore  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1)) * 0.5).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)

    with STRATEGY.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = SafeDistributedModel(
            inputs,
            keras.layers.Dense(1)(hidden),
            gradient_accumulation_steps=2,
            global_clipnorm=1.0,
            log_update_stats=True,
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    # Deleted when training ends; a crashed run resumes from it.
    backup = os.path.join("logs", "multi_worker_backup")
    history = model.fit(
        dataset,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[MultiWorkerBackupAndRestore(backup)],
    )
    checksum = float(sum(np.sum(w) for w in model.get_weights()))
    print(f"weights checksum {checksum:.6f}")
    if is_chief(STRATEGY):
        print(f"replicas across workers: {STRATEGY.num_replicas_in_sync}")
        for epoch, loss in enumerate(history.history["loss"]):
            print(
                f"epoch {epoch + 1}: loss {loss:.4f}, "
                f"samples per update {history.history['samples_per_update'][epoch]:.0f}"
            )


if __name__ == "__main__":
    main()
