"""Speed and memory of `SafeDistributedModel` against stock `keras.Model` on CPU.

Speed: the median time of one `fit()` epoch of the same small MLP, on one
device and on two replicas (two logical CPUs under one `MirroredStrategy`).
Stock and safe epochs are interleaved, alternating which goes first, after a
warm-up epoch of each, so drift hits both alike.

Memory: the peak of TensorFlow's CPU allocator during `fit()` of a convolutional
model whose activations dwarf its parameters, on one device, for stock Keras
with micro-batch `m`, stock Keras with `4m`, and `SafeDistributedModel` with
`m` and `gradient_accumulation_steps=4`. Each configuration runs in a fresh
process so that peaks never mix. Accumulation should cost at most one copy of
the trainable parameters (the accumulators) over stock(m).

Usage:
    PYTHONPATH=. python benchmarks/bench_model.py [--repeats N] [--quick] [--json]
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import tensorflow as tf

# Two logical CPUs for the 2-replica runs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402

from _timing import no_collection  # noqa: E402
from _timing import run_worker  # noqa: E402

MIB = 2**20
MEMORY_CONFIGS = {
    # name: (batch size as a multiple of m, gradient_accumulation_steps or None)
    "stock(m)": (1, None),
    "stock(4m)": (4, None),
    "safe(m, k=4)": (1, 4),
}
# Allowed excess of safe(m, k=4) over stock(m) beyond one parameter copy:
# allocator rounding and op-scheduling noise between runs.
MEMORY_TOLERANCE_MIB = 2.0


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


# name: (input features, hidden width, samples, batch size)
SPEED_MODELS = {
    "small MLP": (32, 256, 8192, 256),
    "medium MLP": (256, 1024, 4096, 256),
}


def _mlp(model_class, strategy, features, width):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((features,))
        hidden = keras.layers.Dense(width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        outputs = keras.layers.Dense(10)(hidden)
        return _compile(model_class(inputs, outputs))


EPOCHS_PER_TIMING = 3


def _timed_epoch(model, dataset):
    """Seconds per epoch, averaged over one fit() of a few epochs."""
    with no_collection():
        start = time.perf_counter()
        model.fit(dataset, epochs=EPOCHS_PER_TIMING, verbose=0, shuffle=False)
        return (time.perf_counter() - start) / EPOCHS_PER_TIMING


def bench_speed(repeats, quick):
    """Median epoch seconds of stock and safe, per model and setting."""
    settings = {
        "1 device": tf.distribute.get_strategy(),
        # One MirroredStrategy per process: instances over the same devices
        # can collide on collective keys.
        "2 replicas": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    }
    results = {}
    for model_name, (features, width, samples, batch_size) in SPEED_MODELS.items():
        samples = samples // 2 if quick else samples
        rng = np.random.default_rng(0)
        x = rng.normal(size=(samples, features)).astype("float32")
        y = rng.integers(0, 10, size=samples).astype("int32")
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        for setting, strategy in settings.items():
            models = {
                "stock": _mlp(keras.Model, strategy, features, width),
                "safe": _mlp(SafeDistributedModel, strategy, features, width),
            }
            for model in models.values():
                _timed_epoch(model, dataset)  # warm-up: tracing and building
            times = {name: [] for name in models}
            for repeat in range(repeats):
                order = list(models) if repeat % 2 == 0 else list(models)[::-1]
                for name in order:
                    times[name].append(_timed_epoch(models[name], dataset))
            stock = statistics.median(times["stock"])
            safe = statistics.median(times["safe"])
            paired = [s / k for s, k in zip(times["safe"], times["stock"])]
            results[f"{model_name}, {setting}"] = {
                "model": f"{features}-{width}-{width}-10",
                "samples": samples,
                "batch": batch_size,
                "steps": -(-samples // batch_size),
                "stock_s": stock,
                "safe_s": safe,
                "ratio_of_medians": safe / stock,
                "median_paired_ratio": statistics.median(paired),
                "stock_all_s": times["stock"],
                "safe_all_s": times["safe"],
            }
    return results


def _conv_model(steps):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64, 64, 3))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(hidden)
    hidden = keras.layers.MaxPooling2D(4)(hidden)
    hidden = keras.layers.Flatten()(hidden)
    hidden = keras.layers.Dense(256, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    if steps is None:
        return _compile(keras.Model(inputs, outputs))
    model = SafeDistributedModel(inputs, outputs, gradient_accumulation_steps=steps)
    return _compile(model)


def _proc_status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/self/status")


def memory_worker(config, micro_batch, samples):
    """Runs one configuration; returns its memory figures in bytes."""
    multiple, steps = MEMORY_CONFIGS[config]
    model = _conv_model(steps)
    x = tf.random.normal([samples, 64, 64, 3], seed=1)
    y = tf.random.uniform([samples], 0, 10, dtype=tf.int32, seed=2)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro_batch * multiple)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS
    rss_before = _proc_status_kib("VmRSS") * 1024
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    info = tf.config.experimental.get_memory_info("CPU:0")
    return {
        "peak_growth": info["peak"] - before,
        "retained": info["current"] - before,
        "rss_hwm_growth": _proc_status_kib("VmHWM") * 1024 - rss_before,
        "param_bytes": sum(
            int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_weights
        ),
    }


def _run_worker(config, micro_batch, samples):
    arguments = [
        "--memory-worker", config,
        "--memory-batch", str(micro_batch),
        "--memory-samples", str(samples),
    ]
    return run_worker(os.path.abspath(__file__), arguments, f"memory ({config})")


def bench_memory(micro_batch, samples, runs):
    """Median figures over `runs` fresh processes per configuration."""
    results = {}
    for config in MEMORY_CONFIGS:
        figures = [_run_worker(config, micro_batch, samples) for _ in range(runs)]
        results[config] = {key: statistics.median(f[key] for f in figures) for key in figures[0]}
        peaks = [f["peak_growth"] for f in figures]
        results[config]["peak_growth_range"] = [min(peaks), max(peaks)]
    param_bytes = results["stock(m)"]["param_bytes"]
    excess = results["safe(m, k=4)"]["peak_growth"] - results["stock(m)"]["peak_growth"]
    return {
        "configs": results,
        "param_bytes": param_bytes,
        "excess_over_stock_m": excess,
        "tolerance_bytes": MEMORY_TOLERANCE_MIB * MIB,
        "within_one_param_copy": excess <= param_bytes + MEMORY_TOLERANCE_MIB * MIB,
    }


def _print_report(report):
    speed, memory, setup = report["speed"], report["memory"], report["setup"]
    print(
        f"Speed: median epoch over {setup['repeats']} interleaved fit() calls of "
        f"{EPOCHS_PER_TIMING} epochs; "
        "Adam, no clipping, gradient_accumulation_steps=1"
    )
    print(
        f"{'setting':<26}{'model':>16}{'stock ms':>10}{'safe ms':>10}"
        f"{'ratio of medians':>18}{'median paired ratio':>21}{'extra ms/step':>15}"
    )
    for setting, row in speed.items():
        print(
            f"{setting:<26}{row['model']:>16}{row['stock_s'] * 1e3:>10.1f}"
            f"{row['safe_s'] * 1e3:>10.1f}{row['ratio_of_medians']:>18.3f}"
            f"{row['median_paired_ratio']:>21.3f}"
            f"{(row['safe_s'] - row['stock_s']) * 1e3 / row['steps']:>15.3f}"
        )
    print()
    print(
        f"Memory: TF CPU allocator during one fit() epoch, 1 device, Conv2D model "
        f"on 64x64x3, {setup['memory_samples']} samples, m={setup['memory_batch']}, "
        f"median of {setup['memory_runs']} fresh processes (MiB)"
    )
    print(
        f"{'config':<14}{'batch':>6}{'peak growth':>13}{'(min-max)':>16}"
        f"{'retained':>10}{'RSS HWM growth':>16}"
    )
    for config, row in memory["configs"].items():
        low, high = (v / MIB for v in row["peak_growth_range"])
        batch = MEMORY_CONFIGS[config][0] * setup["memory_batch"]
        print(
            f"{config:<14}{batch:>6}{row['peak_growth'] / MIB:>13.2f}"
            f"{f'({low:.2f}-{high:.2f})':>16}{row['retained'] / MIB:>10.2f}"
            f"{row['rss_hwm_growth'] / MIB:>16.2f}"
        )
    verdict = "yes" if memory["within_one_param_copy"] else "NO"
    print(
        f"one copy of trainable params: {memory['param_bytes'] / MIB:.2f} MiB; "
        f"safe(m, k=4) - stock(m) = {memory['excess_over_stock_m'] / MIB:.2f} MiB; "
        f"<= params + {MEMORY_TOLERANCE_MIB:.1f} MiB tolerance: {verdict}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="timed epochs per model")
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--memory-worker", choices=list(MEMORY_CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--memory-batch", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--memory-samples", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker:
        figures = memory_worker(args.memory_worker, args.memory_batch, args.memory_samples)
        print(json.dumps(figures))
        return
    setup = {
        "repeats": args.repeats or (3 if args.quick else 9),
        "memory_batch": 16 if args.quick else 32,
        "memory_samples": 128 if args.quick else 256,
        "memory_runs": 1 if args.quick else 5,
    }
    if setup["repeats"] < 1:
        parser.error(f"--repeats must be >= 1. Received: --repeats={setup['repeats']}")
    report = {
        "setup": setup,
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "speed": bench_speed(setup["repeats"], args.quick),
        "memory": bench_memory(
            setup["memory_batch"], setup["memory_samples"], setup["memory_runs"]
        ),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)


if __name__ == "__main__":
    main()
