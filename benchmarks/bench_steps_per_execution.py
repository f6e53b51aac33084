"""Epoch time of `SafeDistributedModel` with `steps_per_execution` on two replicas.

Stock Keras cannot run `steps_per_execution > 1` under MirroredStrategy, so
the baseline is stock `keras.Model` on the same two replicas at
`steps_per_execution=1`, its best setting that works. The model is an MLP
64-256-256-10 (ReLU), batch 64, SGD, 6400 samples (100 steps an epoch).
After a warm-up epoch of each configuration, one epoch of each runs per round,
in an order that rotates every round; each configuration's figure is the
median over rounds of its epoch time divided by the same round's baseline
epoch time, and the fixed per-step saving is the difference of the median
epoch times over the steps.

Usage:
    PYTHONPATH=. python benchmarks/bench_steps_per_execution.py [--rounds N] [--json]
"""

import argparse
import json
import statistics
import time

import numpy as np
import tensorflow as tf

# Two logical CPUs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402

from _timing import no_collection  # noqa: E402

SAMPLES, FEATURES, BATCH = 6400, 64, 64
EXECUTIONS = (1, 4, 8, 32)


def _model(model_class, strategy, execution):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(256, activation="relu")(inputs)
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
        model = model_class(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=execution,
        )
    return model


def _epoch(model, x, y):
    with no_collection():
        start = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be an integer >= 1. Received: --rounds={args.rounds}")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, 10, size=SAMPLES).astype("int32")
    configs = {"stock, k=1": _model(keras.Model, strategy, 1)}
    for execution in EXECUTIONS:
        configs[f"safe, k={execution}"] = _model(SafeDistributedModel, strategy, execution)
    for model in configs.values():
        _epoch(model, x, y)  # warm-up: tracing and building
    names = list(configs)
    times = {name: [] for name in names}
    ratios = {name: [] for name in names}
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_epoch(configs[name], x, y))
        for name in names:
            ratios[name].append(times[name][-1] / times["stock, k=1"][-1])
    steps = SAMPLES // BATCH
    base = statistics.median(times["stock, k=1"])
    results = {
        name: {
            "median_epoch_s": statistics.median(times[name]),
            "median_ratio_to_stock_k1": statistics.median(ratios[name]),
            "per_step_us_vs_stock_k1": 1e6 * (statistics.median(times[name]) - base) / steps,
        }
        for name in names
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'configuration':14} {'epoch s':>8} {'ratio':>6} {'per step':>10}")
    for name, r in results.items():
        print(
            f"{name:14} {r['median_epoch_s']:8.3f} {r['median_ratio_to_stock_k1']:6.3f} "
            f"{r['per_step_us_vs_stock_k1']:+8.0f} us"
        )


if __name__ == "__main__":
    main()
