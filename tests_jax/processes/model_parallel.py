"""One process of a multi-process ModelParallel run: its rows, a mesh over every process.

Usage: model_parallel.py OUT MESH (e.g. "2,2": the batch axis over the 2
processes, the model axis over each process's 2 devices). Trains an MLP
whose Dense layers a LayoutMap shards over "model", with accumulation 2 and
clipping, on this process's half of the rows, and writes the trained weights
(gathered) and the accumulators' layouts to OUT/process_<i>.npz.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import keras_safe_dist  # noqa: E402
from keras_safe_dist import SafeDistributedModel  # noqa: E402

BATCH, ACCUMULATION, EPOCHS, CLIP = 8, 2, 3, 0.5


def build(model_class, **options):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(64, activation="relu", name="dense_a")(inputs)
    model = model_class(inputs, keras.layers.Dense(8, name="dense_b")(hidden), **options)
    rng = np.random.default_rng(3)
    for variable in model.weights:  # the same start everywhere
        variable.assign(rng.normal(scale=0.3, size=variable.shape).astype("float32"))
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    return x, (x[:, :8] * 2.0 + 0.1).astype("float32")


if __name__ == "__main__":
    keras_safe_dist.initialize(timeout=30)  # before any JAX computation
    out, shape = sys.argv[1], tuple(int(n) for n in sys.argv[2].split(","))
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["dense.*bias"] = ("model",)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    distribution.auto_shard_dataset = False  # each process passes its own rows
    keras.distribution.set_distribution(distribution)
    model = build(SafeDistributedModel, gradient_accumulation_steps=ACCUMULATION, global_clipnorm=CLIP)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x, y = data()
    process = jax.process_index()
    half = slice(process * 32, (process + 1) * 32)
    model.fit(x[half], y[half], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    weights = [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) for v in model.trainable_variables]
    laid_out = [
        s.value.sharding.spec == v.value.sharding.spec
        for s, v in zip(model._update_engine.sums, model.trainable_variables)
    ]
    np.savez(os.path.join(out, f"process_{process}.npz"), *weights, laid_out=np.array(laid_out))
    print(f"process {process} done", flush=True)
