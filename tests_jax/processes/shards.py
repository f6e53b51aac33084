"""One process of a multi-process JAX run that feeds its own shard of the data.

Started by `keras-safe-dist launch --backend jax` (tests_jax/test_processes.py):

    python shards.py OUT SIZES [--model safe|stock] [--reference]

SIZES are the samples of each process (e.g. 32,33). Each process trains on
its own rows of one pool of samples, evaluates and predicts them, and writes
`OUT/process_<i>.npz`. With `--reference` one process with one device trains
stock Keras on the global batches the processes agreed on (process 0's rows
of each step, then process 1's, ...), one big batch per update, and writes
`OUT/reference.npz`.
"""

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("sizes")
parser.add_argument("--model", default="safe")
parser.add_argument("--reference", action="store_true")
parser.add_argument("--accumulation", type=int, default=1, help="with 1, the model has BatchNormalization")
parser.add_argument("--fail", default="", help="PROCESS:STEP[:EPOCH]: that process raises at that step")
parser.add_argument("--die", default="", help="PROCESS:STEP[:EPOCH]: that process kills itself (SIGKILL) there")
parser.add_argument("--term", default="", help="PROCESS:STEP[:EPOCH]: that process gets SIGTERM there")
parser.add_argument("--pydataset", action="store_true", help="fit on a keras.utils.PyDataset (sizes agreed at each step)")
parser.add_argument("--nan", default="", help="PROCESS:ROW: a NaN in that row of that process's x; NaNOnsetDetector in OUT/nan")
parser.add_argument("--backup", default="", help="train with MultiWorkerBackupAndRestore in this folder")
parser.add_argument("--timeout", type=int, default=60, help="keras_safe_dist.initialize's bound")
parser.add_argument("--epochs-on", default="", help="PROCESS:EPOCHS: that process fits for that many epochs")
parser.add_argument("--end-after-fit", type=int, default=-1, help="that process ends its script after fit()")
args = parser.parse_args()
SIZES = [int(n) for n in args.sizes.split(",")]
BATCH = 8
ACCUMULATION = args.accumulation
EPOCHS = 3

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

if not args.reference:
    import keras_safe_dist  # noqa: E402

    keras_safe_dist.initialize(timeout=args.timeout)

import jax  # noqa: E402
import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist.callbacks import MultiWorkerBackupAndRestore  # noqa: E402
from keras_safe_dist.callbacks import NaNOnsetDetector  # noqa: E402

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from refilling import aligned_empty  # noqa: E402


def pool():
    rng = np.random.default_rng(7)
    total = sum(SIZES)
    x = rng.normal(size=(total, 6)).astype("float32")
    y = rng.normal(size=(total, 2)).astype("float32")
    weights = rng.uniform(0.5, 2.0, size=(total,)).astype("float32")
    bounds = np.cumsum([0] + SIZES)
    return [(x[a:b], y[a:b], weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def build(model_class, **options):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    if ACCUMULATION == 1:
        # Batch statistics are those of each micro-batch: one update per batch.
        hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(2)(hidden)
    model = model_class(inputs, outputs, **options)
    rng = np.random.default_rng(3)
    for variable in model.weights:
        if "kernel" in variable.path:  # the same start on every process
            variable.assign(rng.normal(scale=0.3, size=variable.shape).astype("float32"))
    return model


CLIP = 0.5


def global_batches(shards):
    """Step k's global batch: each process's k-th local batch, in process order."""
    steps = max(-(-len(x) // BATCH) for x, _, _ in shards)
    batches = []
    for step in range(steps):
        parts = [tuple(a[step * BATCH : (step + 1) * BATCH] for a in shard) for shard in shards]
        batches.append(tuple(np.concatenate(column) for column in zip(*parts)))
    return batches


def reference(shards):
    model = build(keras.Model)
    model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=CLIP), loss="mse", weighted_metrics=["mae"])
    batches = global_batches(shards)
    for _ in range(EPOCHS):
        # One big batch per update: the concatenation of ACCUMULATION global batches.
        for start in range(0, len(batches), ACCUMULATION):
            group = batches[start : start + ACCUMULATION]
            x, y, w = (np.concatenate(column) for column in zip(*group))
            model.train_on_batch(x, y, sample_weight=w)
    x, y, w = (np.concatenate(column) for column in zip(*shards))
    loss, mae = model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0)
    predictions = [model.predict(shard[0], verbose=0) for shard in shards if len(shard[0])]
    np.savez(
        os.path.join(args.out, "reference.npz"),
        *model.get_weights(),
        evaluation=np.array([loss, mae]),
        predictions=np.concatenate(predictions),
    )


class Batches(keras.utils.PyDataset):
    """This process's rows in batches of BATCH; Keras does not know their size in advance.

    Each batch is written into the arrays the last batch of its size was in
    (64-byte aligned, which JAX places on a CPU without a copy): the model
    must train on each batch as it was given.
    """

    def __init__(self, *arrays):
        super().__init__()
        self.arrays = arrays
        self.buffers = {}

    def __len__(self):
        return -(-len(self.arrays[0]) // BATCH)

    def __getitem__(self, index):
        rows = [a[index * BATCH : (index + 1) * BATCH] for a in self.arrays]
        if len(rows[0]) not in self.buffers:
            self.buffers[len(rows[0])] = [aligned_empty(r.shape, r.dtype) for r in rows]
        buffers = self.buffers[len(rows[0])]
        for buffer, r in zip(buffers, rows):
            buffer[:] = r
        return tuple(buffers)


class FailAt(keras.callbacks.Callback):
    def __init__(self, step, epoch, kill):
        super().__init__()
        self.step = step
        self.epoch = epoch
        self.kill = kill
        self.current = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if batch != self.step or self.current != self.epoch:
            return
        print(f"process {jax.process_index()} fails at step {batch}: {time.time()}", flush=True)
        if self.kill:
            os.kill(os.getpid(), self.kill)
        raise RuntimeError(f"process {jax.process_index()} fails at step {batch}")


def train(shards):
    global EPOCHS
    process = jax.process_index()
    if args.epochs_on and int(args.epochs_on.split(":")[0]) == process:
        EPOCHS = int(args.epochs_on.split(":")[1])
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # each process passes its own rows
    keras.distribution.set_distribution(distribution)
    x, y, w = shards[process]
    if args.model == "safe":
        model = build(SafeDistributedModel, gradient_accumulation_steps=ACCUMULATION, global_clipnorm=CLIP)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", weighted_metrics=["mae"])
    else:
        model = build(keras.Model)
        model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=CLIP), loss="mse", weighted_metrics=["mae"])
    callbacks = []
    for option, kill in ((args.fail, None), (args.die, signal.SIGKILL), (args.term, signal.SIGTERM)):
        if option:
            who, step, epoch = ([int(n) for n in option.split(":")] + [0])[:3]
            if who == process:
                callbacks.append(FailAt(step, epoch, kill))
    if args.backup:
        callbacks.append(MultiWorkerBackupAndRestore(args.backup))
    if args.nan:
        who, row = (int(n) for n in args.nan.split(":"))
        if who == process:
            x = x.copy()
            x[row, 0] = np.nan
        callbacks.append(NaNOnsetDetector(os.path.join(args.out, "nan"), action="stop"))
    if args.pydataset:
        model.fit(Batches(x, y, w), epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    else:
        model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    if args.end_after_fit == process:
        print(f"process {process} ends after fit()", flush=True)
        return
    loss, mae = model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    np.savez(
        os.path.join(args.out, f"process_{process}.npz"),
        *model.get_weights(),
        evaluation=np.array([loss, mae]),
        predictions=predictions,
    )
    print(f"process {process} done: loss {loss:.6f}", flush=True)


if __name__ == "__main__":
    shards = pool()
    if args.reference:
        reference(shards)
    else:
        train(shards)
