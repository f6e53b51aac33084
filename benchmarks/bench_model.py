"""Speed and memory of `SafeDistributedModel` against stock `keras.Model` on CPU.

Five sections, all by default, or those named with `--only`:

- `plain`: the plain step (default arguments, no callbacks) against stock, on
  one device and on two replicas (two logical CPUs under one
  `MirroredStrategy`), for an MLP 64-256-256-10 at batch 64 and an MLP
  256-1024-1024-10 at batch 256.
- `execution`: `steps_per_execution` k = 1, 4, 8, 32 on two replicas against
  stock at k = 1 on the same replicas (stock crashes there for k > 1), on the
  MLP 64-256-256-10.
- `first_epoch`: the first epoch of a new model (tracing included) with
  `steps_per_execution` k = 1 and 8 on two replicas against stock at k = 1
  on the same replicas, for the MLP 64-256-256-10 and the convnet. Each round
  builds every configuration anew, in rotating order.
- `xla`: `jit_compile=True` against off on two replicas, for the MLP
  64-256-256-10 and a small convnet.
- `memory`: the peak of TensorFlow's CPU allocator during `fit()` of a
  convolutional model whose activations dwarf its parameters, on one device,
  for stock Keras with micro-batch `m`, with `4m`, and `SafeDistributedModel`
  with `m` and `gradient_accumulation_steps=4`, each in a fresh process.
  Accumulation should cost at most one copy of the trainable parameters.

With `--backend jax` it runs instead, in a process of its own
(benchmarks/_model_jax.py, KERAS_BACKEND=jax): SafeDistributedModel against
stock Keras on two CPU devices under `keras.distribution.DataParallel`,
batches they divide, for the MLP 64-256-256-10 and the convnet at batch 64,
both with `jit_compile=True`, and SafeDistributedModel with
`skip_nonfinite=False` beside them.

Speed method: after a warm-up epoch of each configuration, each round runs
one epoch of every configuration of a group, in an order that rotates every
round, so drift hits all alike. A configuration's ratio is the median over
rounds of its epoch time divided by the same round's baseline epoch; its fixed
cost per step is the difference of the median epoch times over the steps.

Usage:
    PYTHONPATH=. python benchmarks/bench_model.py [--only SECTION ...] [--rounds N] [--quick] [--json]
    PYTHONPATH=. python benchmarks/bench_model.py --backend jax [--rounds N] [--quick] [--json]
"""

import argparse
import functools
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

from _timing import epoch_seconds  # noqa: E402
from _timing import interleave  # noqa: E402
from _timing import no_collection  # noqa: E402
from _timing import run_worker  # noqa: E402

SECTIONS = ("plain", "execution", "first_epoch", "xla", "memory")
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

# name: (input shape, hidden width or None for the convnet, samples, batch size)
MODELS = {
    "MLP 64-256-256-10": ((64,), 256, 6400, 64),
    "MLP 256-1024-1024-10": ((256,), 1024, 4096, 256),
    "convnet 28x28x1": ((28, 28, 1), None, 1280, 64),
}
EXECUTIONS = (1, 4, 8, 32)


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def _model(name, model_class, strategy, **compile_options):
    """One of `MODELS`, built and compiled (SGD) in `strategy`'s scope."""
    shape, width, _, _ = MODELS[name]
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input(shape)
        if width is None:
            hidden = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
            hidden = keras.layers.Conv2D(16, 3, activation="relu")(hidden)
            hidden = keras.layers.GlobalAveragePooling2D()(hidden)
        else:
            hidden = keras.layers.Dense(width, activation="relu")(inputs)
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = model_class(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **{"jit_compile": False, **compile_options},
        )
    return model


def _data(name, quick):
    shape, _, samples, batch = MODELS[name]
    samples = samples // 4 if quick else samples
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, *shape)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    return x, y, batch


_epoch = epoch_seconds


def step_times(configs, x, y, batch, rounds, steps):
    """Microseconds per call of each model's train function, in blocks of `steps`.

    Calls `train_function` directly on a repeated dataset, as `fit()` does
    between callbacks, with one host read per block: the step's own cost,
    without Keras's per-step Python work (the same for every model).

    Returns:
        name: median microseconds per step over `rounds` interleaved blocks.
    """
    times = {name: [] for name in configs}
    iterators = {}
    for name, model in configs.items():
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
        iterators[name] = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))
        model.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, verbose=0)  # builds
        for _ in range(5):
            model.train_function(iterators[name])  # warm-up: tracing
    names = list(configs)
    with no_collection():
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                function, iterator = configs[name].train_function, iterators[name]
                start = time.perf_counter()
                for _ in range(steps):
                    logs = function(iterator)
                float(logs["loss"])
                times[name].append(1e6 * (time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_plain(strategies, rounds, quick):
    """The plain step against stock, per model and setting: whole epochs, and steps alone."""
    results = {}
    for name in ("MLP 64-256-256-10", "MLP 256-1024-1024-10"):
        x, y, batch = _data(name, quick)
        for setting, strategy in strategies.items():
            configs = {
                "stock": _model(name, keras.Model, strategy),
                "safe": _model(name, SafeDistributedModel, strategy),
            }
            timed = interleave(configs, "stock", x, y, batch, rounds)
            # The skip decision waits for every gradient before any update.
            configs["no skip"] = _model(
                name, functools.partial(SafeDistributedModel, skip_nonfinite=False), strategy
            )
            steps = step_times(configs, x, y, batch, rounds, max(10, -(-len(x) // batch)))
            results[f"{name}, batch {batch}, {setting}"] = dict(
                timed["safe"],
                step_us={key: round(value, 1) for key, value in steps.items()},
                step_cost_us=steps["safe"] - steps["stock"],
                no_skip_step_cost_us=steps["no skip"] - steps["stock"],
            )
    return results


def bench_execution(strategy, rounds, quick):
    """`steps_per_execution` on two replicas against stock at k = 1."""
    name = "MLP 64-256-256-10"
    x, y, batch = _data(name, quick)
    configs = {"stock, k=1": _model(name, keras.Model, strategy)}
    for k in EXECUTIONS:
        configs[f"safe, k={k}"] = _model(
            name, SafeDistributedModel, strategy, steps_per_execution=k
        )
    return interleave(configs, "stock, k=1", x, y, batch, rounds)


def bench_first_epoch(strategy, rounds, quick):
    """A new model's first epoch, k = 1 and 8 on two replicas, against stock at k = 1."""
    configs = {
        "stock, k=1": functools.partial(_model, model_class=keras.Model),
        "safe, k=1": functools.partial(_model, model_class=SafeDistributedModel),
        "safe, k=8": functools.partial(
            _model, model_class=SafeDistributedModel, steps_per_execution=8
        ),
    }
    names = list(configs)
    results = {}
    for model_name in ("MLP 64-256-256-10", "convnet 28x28x1"):
        x, y, batch = _data(model_name, quick)
        _epoch(configs["stock, k=1"](model_name, strategy=strategy), x, y, batch)  # warm-up
        times = {name: [] for name in names}
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                model = configs[name](model_name, strategy=strategy)
                times[name].append(_epoch(model, x, y, batch))
        results[f"{model_name}, batch {batch}"] = {
            name: {
                "median_epoch_s": statistics.median(times[name]),
                "median_ratio": statistics.median(
                    t / b for t, b in zip(times[name], times["stock, k=1"])
                ),
            }
            for name in names
        }
    return results


def bench_xla(strategy, rounds, quick):
    """`jit_compile=True` against off on two replicas, per model."""
    results = {}
    for name in ("MLP 64-256-256-10", "convnet 28x28x1"):
        x, y, batch = _data(name, quick)
        configs = {
            "off": _model(name, SafeDistributedModel, strategy),
            "on": _model(name, SafeDistributedModel, strategy, jit_compile=True),
        }
        timed = interleave(configs, "off", x, y, batch, rounds)
        results[f"{name}, batch {batch}"] = timed["on"]
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


def _print_timed(title, rows, baseline):
    print(title)
    print(f"{'configuration':<48}{'epoch ms':>10}{'ratio':>8}{'per step':>12}")
    for name, row in rows.items():
        print(
            f"{name:<48}{row['median_epoch_s'] * 1e3:>10.1f}{row['median_ratio']:>8.3f}"
            f"{row['per_step_us']:>+9.0f} us"
        )
    print(f"(ratio: median over rounds of epoch time / {baseline}; per step: against it)")
    print()


def _print_memory(memory, setup):
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


def _print_plain(rows, rounds):
    print(f"Plain step, SafeDistributedModel against stock keras.Model ({rounds} rounds; SGD)")
    print(
        f"{'configuration':<48}{'epoch ratio':>12}{'per step':>11}"
        f"{'stock step':>12}{'safe step':>11}{'step cost':>11}{'without skip':>14}"
    )
    for name, row in rows.items():
        print(
            f"{name:<48}{row['median_ratio']:>12.3f}{row['per_step_us']:>+8.0f} us"
            f"{row['step_us']['stock']:>9.0f} us{row['step_us']['safe']:>8.0f} us"
            f"{row['step_cost_us']:>+8.0f} us{row['no_skip_step_cost_us']:>+11.0f} us"
        )
    print(
        "(epoch ratio: median over rounds of safe / stock epoch time; per step: from the"
        " median epochs; step: train_function alone, median us per step; without skip:"
        " the step cost with skip_nonfinite=False)"
    )
    print()


def _print_report(report):
    rounds = report["setup"]["rounds"]
    if "plain" in report:
        _print_plain(report["plain"], rounds)
    if "execution" in report:
        _print_timed(
            f"steps_per_execution on 2 replicas, MLP 64-256-256-10, batch 64 ({rounds} rounds)",
            report["execution"],
            "stock's at k=1",
        )
    if "first_epoch" in report:
        print(f"First epoch of a new model on 2 replicas, tracing included ({rounds} rounds)")
        print(f"{'configuration':<48}{'epoch ms':>10}{'ratio':>8}")
        for model_name, rows in report["first_epoch"].items():
            for name, row in rows.items():
                print(
                    f"{model_name + ', ' + name:<48}{row['median_epoch_s'] * 1e3:>10.1f}"
                    f"{row['median_ratio']:>8.3f}"
                )
        print("(ratio: median over rounds of first-epoch time / stock's at k=1, same round)")
        print()
    if "xla" in report:
        _print_timed(
            f"jit_compile=True on 2 replicas, SafeDistributedModel ({rounds} rounds)",
            report["xla"],
            "the same model's without XLA",
        )
    if "memory" in report:
        _print_memory(report["memory"], report["setup"])


def _print_jax(report, rounds):
    load = ", ".join(f"{value:.1f}" for value in report["load_average"])
    print(
        f"JAX backend, {report['devices']} CPU devices under DataParallel, jit_compile=True "
        f"({rounds} rounds; SGD; load average at the end {load})"
    )
    print(
        f"{'configuration':<34}{'epoch ms':>9}{'ratio (95% CI)':>22}{'per step':>11}"
        f"{'step':>10}{'step cost':>11}"
    )

    def ratio(value, interval):
        return f"{value:.3f} ({interval[0]:.3f}-{interval[1]:.3f})"

    for model_name, rows in report["results"].items():
        print(model_name)
        for name, row in rows.items():
            print(
                f"  {name:<32}{row['median_epoch_s'] * 1e3:>9.1f}"
                f"{ratio(row['median_ratio'], row['ratio_interval']):>22}"
                f"{row['per_step_us']:>+8.0f} us"
                f"{row['step_us']:>7.0f} us{row['step_cost_us']:>+8.0f} us"
            )
    print(
        "(ratio: median over rounds of epoch time / stock's, same round, with a 95% bootstrap"
        " interval; per step: from the median epochs, against stock; step: train_function"
        " alone, median us per step)"
    )


def bench_jax(rounds, quick):
    """The JAX comparison, in a process of its own (the backend is fixed at import)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_model_jax.py")
    arguments = ["--rounds", str(rounds)] + (["--quick"] if quick else [])
    return run_worker(script, arguments, "JAX", env={"KERAS_BACKEND": "jax"})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run"
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9)")
    parser.add_argument("--quick", action="store_true", help="small sizes and 3 rounds, a smoke check")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--backend",
        choices=("tensorflow", "jax"),
        default="tensorflow",
        help="jax: SafeDistributedModel against stock Keras on Keras's JAX backend (its own section)",
    )
    parser.add_argument("--memory-worker", choices=list(MEMORY_CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--memory-batch", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--memory-samples", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker:
        figures = memory_worker(args.memory_worker, args.memory_batch, args.memory_samples)
        print(json.dumps(figures))
        return
    setup = {
        "rounds": args.rounds or (3 if args.quick else 9),
        "memory_batch": 16 if args.quick else 32,
        "memory_samples": 128 if args.quick else 256,
        "memory_runs": 1 if args.quick else 5,
        "cpu_count": os.cpu_count(),
    }
    if setup["rounds"] < 1:
        parser.error(f"--rounds must be an integer >= 1. Received: --rounds={setup['rounds']}")
    if args.backend == "jax":
        report = bench_jax(setup["rounds"], args.quick)
        if args.json:
            print(json.dumps({"setup": setup, **report}, indent=2))
        else:
            _print_jax(report, setup["rounds"])
        return
    # One MirroredStrategy per process: instances over the same devices can
    # collide on collective keys.
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    report = {
        "setup": setup,
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
    }
    rounds, quick = setup["rounds"], args.quick
    if "plain" in args.only:
        strategies = {"1 device": tf.distribute.get_strategy(), "2 replicas": mirrored}
        report["plain"] = bench_plain(strategies, rounds, quick)
    if "execution" in args.only:
        report["execution"] = bench_execution(mirrored, rounds, quick)
    if "first_epoch" in args.only:
        report["first_epoch"] = bench_first_epoch(mirrored, rounds, quick)
    if "xla" in args.only:
        report["xla"] = bench_xla(mirrored, rounds, quick)
    if "memory" in args.only:
        report["memory"] = bench_memory(
            setup["memory_batch"], setup["memory_samples"], setup["memory_runs"]
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)


if __name__ == "__main__":
    main()
