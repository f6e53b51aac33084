"""Several JAX processes, each training on its own share of the data.

Every process runs this script: it joins the others, lays a
`keras.distribution.DataParallel` over all their devices and fits a
SafeDistributedModel (2 micro-batches per update, clipped to a global norm of
1.0) on its own rows of one synthetic data set. Each step's global batch is 32
samples: process 0's rows, then process 1's, as one device would train on them.

Run two local processes, one CPU device each (on one machine, processes would
otherwise share its GPUs):

    JAX_PLATFORMS=cpu keras-safe-dist launch --backend jax --workers 2 examples/jax_processes.py

Process 0, the chief, prints one line (the launcher prefixes `[worker 0]`):

    processes: 2, devices: 2, loss: 0.3722 after epoch 1, 0.158675 after epoch 5

On a cluster, see docs/scaling_out.md ("On JAX: several processes").
"""

from _extras import require

require("jax")  # or exit naming the [jax] extra and its install command

import keras_safe_dist  # noqa: E402

keras_safe_dist.initialize()  # first: joins the other processes (the launcher's variables)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

GLOBAL_BATCH = 32
process, count = jax.process_index(), jax.process_count()
keras.utils.set_random_seed(0)  # the same first weights in every run
distribution = keras.distribution.DataParallel(devices=jax.devices())  # every process's devices
distribution.auto_shard_dataset = False  # each process passes its own rows
keras.distribution.set_distribution(distribution)  # before building the model

rng = np.random.default_rng(0)  # the same 1024 samples on every process...
x = rng.normal(size=(1024, 8)).astype("float32")
y = np.tanh(x @ rng.normal(size=(8, 1))).astype("float32")
x, y = x[process::count], y[process::count]  # ...of which this one keeps every count-th

inputs = keras.Input((8,))
hidden = keras.layers.Dense(32, activation="relu")(inputs)
model = keras_safe_dist.SafeDistributedModel(
    inputs, keras.layers.Dense(1)(hidden), gradient_accumulation_steps=2, global_clipnorm=1.0
)
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
# Local batches of 32 // count rows; shuffle=False: the same batches as one process.
history = model.fit(x, y, batch_size=GLOBAL_BATCH // count, epochs=5, shuffle=False, verbose=0)
if keras_safe_dist.is_chief():
    losses = history.history["loss"]
    print(
        f"processes: {count}, devices: {len(jax.devices())}, "
        f"loss: {losses[0]:.4f} after epoch 1, {losses[-1]:.6f} after epoch 5"
    )
