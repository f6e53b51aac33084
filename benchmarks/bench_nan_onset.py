"""Step time of `SafeDistributedModel` with and without `NaNOnsetDetector`, and under
`tf.debugging.enable_check_numerics`, on the same MLP while training is healthy.

Two models: a small MLP (32-256-256-10, about 1.6 ms per step on 2 CPU cores),
where the detector's fixed per-step cost weighs most, and a medium MLP
(256-1024-1024-10). Each runs on one device, on one device with
`jit_compile=True` (XLA), and on two replicas (two logical CPUs under one
`MirroredStrategy`). In this process, fit() calls without the detector (twice,
with two traces of the same step, "none" and "none, second trace", whose
ratio shows the noise floor), with `NaNOnsetDetector()` ("stop") and with
`NaNOnsetDetector(action="restore")` alternate (rotating which goes first),
after a warm-up call of each, all on the same model. The "fit" rows give median seconds per
epoch and ratios to "none". The "steps" rows then time, the same way, only
what fit() runs for each batch (the train function, the logs turned into
Python numbers, the detector's batch-end hook) over one epoch's worth of
steps, many more times: the per-batch cost without fit()'s per-epoch work.

`tf.debugging.enable_check_numerics` is global and cannot be turned off, so it
runs in a subprocess: that process times "none" first (its own baseline),
then enables the checks and times the same model again, on one device.

A second subprocess pins itself to one CPU core before TensorFlow starts and
times the "steps" rows of each model on one device there ("one core"): without
a second core to overlap work, and with less scheduling noise, its ratios
measure the detector's CPU work. The two-core rows are the time a user waits.

Usage:
    PYTHONPATH=. python benchmarks/bench_nan_onset.py [--repeats N] [--quick] [--json]
        [--models "small MLP,medium MLP"]
"""

import argparse
import json
import os
import statistics
import sys
import time

ONE_CORE_FLAG = "--one-core-worker"
if ONE_CORE_FLAG in sys.argv:  # before TensorFlow sizes its thread pools
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two logical CPUs for the 2-replica runs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist.callbacks import NaNOnsetDetector  # noqa: E402

from _timing import no_collection  # noqa: E402
from _timing import run_worker  # noqa: E402

# name: (input features, hidden width, samples)
MODELS = {"small MLP": (32, 256, 8192), "medium MLP": (256, 1024, 4096)}
BATCH = 256
EPOCHS_PER_TIMING = 3
STEP_REPEATS = 60  # timings of one epoch's worth of train steps, per configuration
CONFIGS = {
    "none": lambda: [],
    # The same configuration traced a second time: the noise floor of the ratios.
    "none, second trace": lambda: [],
    "detector": lambda: [NaNOnsetDetector()],
    "detector (restore)": lambda: [NaNOnsetDetector(action="restore")],
}


def _model(strategy, features, width, jit_compile=False, model_class=SafeDistributedModel):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((features,))
        hidden = keras.layers.Dense(width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = model_class(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
    return model


def _dataset(samples, features):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _timed_epoch(model, dataset, callbacks):
    """Seconds per epoch, averaged over one fit() of a few epochs."""
    with no_collection():
        start = time.perf_counter()
        model.fit(dataset, epochs=EPOCHS_PER_TIMING, verbose=0, shuffle=False, callbacks=callbacks)
        return (time.perf_counter() - start) / EPOCHS_PER_TIMING


def bench_detector(repeats, scale, models):
    """Median epoch seconds per configuration, model and setting, interleaved."""
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {}
    for model_name in models:
        features, width, samples = MODELS[model_name]
        samples = samples // scale
        dataset = _dataset(samples, features)
        settings = (
            ("1 device", tf.distribute.get_strategy(), False),
            ("1 device, XLA", tf.distribute.get_strategy(), True),
            ("2 replicas", mirrored, False),
        )
        for setting, strategy, jit_compile in settings:
            fit_rows, step_rows = _bench_setting(
                repeats, strategy, dataset, samples, features, width, jit_compile
            )
            results[f"{model_name}, {setting}, fit"] = fit_rows
            results[f"{model_name}, {setting}, steps"] = step_rows
    return results


# Every configuration trains the same model: two model instances of the same
# configuration differ by a few percent on this machine, more than the effect
# measured. fit() builds a new train function when the detector's request
# changes, so each configuration's train function, update engine and probe are
# kept after its warm-up and put back before each of its timed calls.
_STEP_STATE = ("train_function", "_update_engine", "_nan_probe", "_xla_step")


def _bench_setting(repeats, strategy, dataset, samples, features, width, jit_compile):
    """`(fit rows, step rows)`: whole fit() calls, then the train steps alone.

    With `repeats=0`, only the steps (fit rows None).
    """
    model = _model(strategy, features, width, jit_compile)
    states = {}
    for name in CONFIGS:
        model.train_function = None  # a fresh trace for each configuration
        _timed_epoch(model, dataset, CONFIGS[name]())  # warm-up: tracing
        states[name] = {attribute: getattr(model, attribute) for attribute in _STEP_STATE}

    def use(name):
        for attribute, value in states[name].items():
            setattr(model, attribute, value)

    fit_times = {name: [] for name in CONFIGS}
    for name in _rotations(repeats):
        use(name)
        fit_times[name].append(_timed_epoch(model, dataset, CONFIGS[name]()))
    steps = -(-samples // BATCH)
    fit_rows = _summary(fit_times, steps, "epoch") if repeats else None
    iterator = iter(strategy.experimental_distribute_dataset(dataset.repeat()))
    step_times = {name: [] for name in CONFIGS}
    for name in _rotations(STEP_REPEATS):
        use(name)
        step_times[name].append(_timed_steps(model, iterator, CONFIGS[name](), steps))
    return fit_rows, _summary(step_times, 1, "step")


def _rotations(repeats):
    """Configuration names, `repeats` rounds, rotating which goes first."""
    names = list(CONFIGS)
    for repeat in range(repeats):
        shift = repeat % len(names)
        yield from names[shift:] + names[:shift]


def _timed_steps(model, iterator, callbacks, steps):
    """Seconds per step of what fit() runs for each batch: the train function,
    the logs turned into Python numbers, and the callbacks' batch-end hook."""
    for callback in callbacks:
        callback.set_model(model)
        callback.on_train_begin()
    with no_collection():
        start = time.perf_counter()
        for batch in range(steps):
            logs = {name: float(value) for name, value in model.train_function(iterator).items()}
            for callback in callbacks:
                callback.on_train_batch_end(batch, logs)
        return (time.perf_counter() - start) / steps


def _summary(times, steps, unit):
    """Rows of medians and ratios to "none"; `steps` per timed `unit`."""
    base = statistics.median(times["none"])
    rows = {}
    for name, values in times.items():
        median = statistics.median(values)
        paired = [v / b for v, b in zip(values, times["none"])]
        rows[name] = {
            "unit": unit,
            "median_s": median,
            "ratio_of_medians": median / base,
            # The fastest run is the least disturbed by other load on the machine.
            "ratio_of_minimums": min(values) / min(times["none"]),
            "median_paired_ratio": statistics.median(paired),
            "extra_ms_per_step": (median - base) * 1e3 / steps,
            "all_s": values,
        }
    return rows


def check_numerics_worker(repeats, samples):
    """Runs in a subprocess: 'none', then the same small MLP with check_numerics."""
    features, width, _ = MODELS["small MLP"]
    dataset = _dataset(samples, features)
    model = _model(tf.distribute.get_strategy(), features, width)
    _timed_epoch(model, dataset, [])
    times = {"none": [_timed_epoch(model, dataset, []) for _ in range(repeats)]}
    tf.debugging.enable_check_numerics()
    model = _model(tf.distribute.get_strategy(), features, width)
    _timed_epoch(model, dataset, [])
    times["check_numerics"] = [_timed_epoch(model, dataset, []) for _ in range(repeats)]
    return times


def bench_check_numerics(repeats, samples):
    arguments = ["--check-numerics-worker", "--repeats", str(repeats), "--samples", str(samples)]
    times = run_worker(os.path.abspath(__file__), arguments, "check_numerics")
    return _summary(times, -(-samples // BATCH), "epoch")


def one_core_worker(scale, models):
    """Runs in a subprocess pinned to one core: the steps rows on one device."""
    results = {}
    for model_name in models:
        features, width, samples = MODELS[model_name]
        samples = samples // scale
        _, step_rows = _bench_setting(
            0, tf.distribute.get_strategy(), _dataset(samples, features), samples, features,
            width, jit_compile=False,
        )
        results[f"{model_name}, 1 device, one core, steps"] = step_rows
    return results


def bench_one_core(scale, models):
    arguments = [ONE_CORE_FLAG, "--models", ",".join(models), *(["--quick"] if scale > 1 else [])]
    return run_worker(os.path.abspath(__file__), arguments, "one-core")


def _print_report(report):
    setup = report["setup"]
    print(
        f"fit rows: median ms per epoch over {setup['repeats']} interleaved fit() calls of "
        f"{EPOCHS_PER_TIMING} epochs. steps rows: median ms per step over {STEP_REPEATS} "
        f"interleaved runs of one epoch's steps. SafeDistributedModel, batch {BATCH}, Adam."
    )
    header = f"{'setting':<40}{'config':<22}{'ms':>10}{'ratio of medians':>18}"
    print(header + f"{'median paired ratio':>21}{'ratio of minimums':>19}{'extra ms/step':>15}")
    sections = dict(report["detector"])
    sections.update(report["one_core"])
    sections["small MLP, 1 device, own process, fit"] = report["check_numerics"]
    for setting, rows in sections.items():
        for name, row in rows.items():
            print(
                f"{setting:<40}{name:<22}{row['median_s'] * 1e3:>10.2f}"
                f"{row['ratio_of_medians']:>18.3f}{row['median_paired_ratio']:>21.3f}"
                f"{row['ratio_of_minimums']:>19.3f}{row['extra_ms_per_step']:>15.3f}"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="timed fit() calls per config")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of: {', '.join(MODELS)}"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--samples", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--check-numerics-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(ONE_CORE_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    scale = 4 if args.quick else 1
    samples = args.samples or MODELS["small MLP"][2] // scale
    if repeats < 1:
        parser.error(f"--repeats must be >= 1. Received: --repeats={repeats}")
    models = [name.strip() for name in args.models.split(",")]
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        parser.error(
            f"--models must name models among: {', '.join(MODELS)}. Received: --models={args.models}"
        )
    if args.check_numerics_worker:
        print(json.dumps(check_numerics_worker(repeats, samples)))
        return
    if args.one_core_worker:
        print(json.dumps(one_core_worker(scale, models)))
        return
    report = {
        "setup": {"repeats": repeats, "models": MODELS, "scale": scale, "batch": BATCH},
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "detector": bench_detector(repeats, scale, models),
        # Pinning a process to a core needs os.sched_setaffinity (Linux).
        "one_core": bench_one_core(scale, models) if hasattr(os, "sched_setaffinity") else {},
        "check_numerics": bench_check_numerics(repeats, samples),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)


if __name__ == "__main__":
    main()
