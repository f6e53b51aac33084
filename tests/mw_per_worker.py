"""A worker of the per-worker data tests (run through keras_safe_dist.scale_out.launch).

Each worker reads its own rows of `data(n0, n1)` (worker 0 the first n0, worker
1 the next n1), through `distribute_datasets_from_function` ("dff") or a
tf.data.Dataset with auto_shard_policy OFF ("off"): trains a small
SafeDistributedModel with per-worker validation data, evaluates it (and
predicts with it) on per-worker data, and prints `RESULT <json>`.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

# The strategy must exist before any other TensorFlow op.
STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402

GLOBAL_BATCH = 8  # 4 rows per replica


def data(n0, n1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n0 + n1, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + 0.1).astype("float32")
    return x, y


def own_rows(sizes, seed):
    """This worker's rows of `data(*sizes, seed)`."""
    n0, n1 = sizes
    x, y = data(n0, n1, seed)
    rows = slice(0, n0) if STRATEGY.cluster_resolver.task_id == 0 else slice(n0, n0 + n1)
    return x[rows], y[rows]


def per_worker(kind, sizes, seed, repeat=False):
    x, y = own_rows(sizes, seed)
    if kind == "dff":
        def dataset_fn(context):
            per_replica = context.get_per_replica_batch_size(GLOBAL_BATCH)
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)
            return dataset.repeat() if repeat else dataset

        return STRATEGY.distribute_datasets_from_function(dataset_fn)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    return (dataset.repeat() if repeat else dataset).with_options(options)


def sizes(text):
    return tuple(int(n) for n in text.split("/"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", choices=["dff", "off"], required=True)
    parser.add_argument("--train", type=sizes, required=True, help="n0/n1 training rows")
    parser.add_argument("--val", type=sizes, required=True, help="n0/n1 validation rows")
    parser.add_argument("--test", type=sizes, required=True, help="n0/n1 evaluation rows")
    parser.add_argument("--steps", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeat-on-chief", action="store_true",
                        help="also evaluate on data that repeats forever on worker 0 only")
    parser.add_argument("--predict", action="store_true")
    args = parser.parse_args()
    with STRATEGY.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3, activation="tanh")(inputs)
        model = SafeDistributedModel(
            inputs, keras.layers.Dense(1)(hidden), gradient_accumulation_steps=args.steps
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(
        per_worker(args.input, args.train, seed=0), epochs=args.epochs, verbose=0,
        validation_data=per_worker(args.input, args.val, seed=1),
    )
    result = {
        "history": history.history,
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
        "evaluate": model.evaluate(per_worker(args.input, args.test, seed=2), verbose=0, return_dict=True),
    }
    if args.predict:
        result["predict"] = model.predict(per_worker(args.input, args.test, seed=2), verbose=0).tolist()
    if args.repeat_on_chief:
        chief = STRATEGY.cluster_resolver.task_id == 0
        try:
            model.evaluate(per_worker(args.input, args.test, seed=2, repeat=chief), verbose=0)
            result["repeat_on_chief"] = None
        except ValueError as error:
            result["repeat_on_chief"] = str(error)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
