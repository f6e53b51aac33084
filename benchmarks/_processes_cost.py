"""One process of bench_processes.py's cost measurement (started with Keras's variables).

Trains the MLP 64-256-256-10 on 64 samples per process per step, even
shards, alternating runs with and without the agreement on the global batch
(`_shares.agreed_iterators`), and process 0 prints one JSON line per pair.
"""

import json
import sys
import time

import keras_safe_dist

keras_safe_dist.initialize(timeout=60)

import contextlib  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist.backend.jax import _process_batch as _shares  # noqa: E402

PAIRS = int(sys.argv[1])
STEPS = 100
BATCH = 64

distribution = keras.distribution.DataParallel(devices=jax.devices())
distribution.auto_shard_dataset = False
keras.distribution.set_distribution(distribution)
inputs = keras.Input((64,))
hidden = keras.layers.Dense(256, activation="relu")(keras.layers.Dense(256, activation="relu")(inputs))
model = SafeDistributedModel(inputs, keras.layers.Dense(10)(hidden))
model.compile(optimizer="sgd", loss="mse")
rng = np.random.default_rng(jax.process_index())
x = rng.normal(size=(STEPS * BATCH, 64)).astype("float32")
y = rng.normal(size=(STEPS * BATCH, 10)).astype("float32")
agreed = _shares.agreed_iterators


def timed(agree):
    _shares.agreed_iterators = agreed if agree else contextlib.nullcontext
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # compiled, warm
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return (time.perf_counter() - start) / STEPS


for pair in range(PAIRS):
    order = (True, False) if pair % 2 == 0 else (False, True)
    seconds = {agree: timed(agree) for agree in order}
    if jax.process_index() == 0:
        print(json.dumps({"agreed": seconds[True], "keras": seconds[False]}), flush=True)
