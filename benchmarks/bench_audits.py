"""Cost of the audit callbacks: fit() time with and without them, and each audit alone.

Fit: the median time of one `fit()` of 3 epochs of a small MLP with
BatchNormalization and Dropout (`SafeDistributedModel`, Adam), on one device
and on two replicas, with no callbacks and with `ScopeAudit`,
`AggregationAudit` and `TrainingModeAudit` writing to a log directory. The two
arms are interleaved, alternating which goes first, after a warm-up fit of
each, on the same model so that tracing is paid once.

Audits alone: the median wall time of each check on a deeper model (20
Dense + BatchNormalization blocks, ~200 variables with optimizer and metrics),
on two replicas: the aggregation inventory, the scope check, and the training-
mode snapshot plus comparison.

Usage:
    PYTHONPATH=. python benchmarks/bench_audits.py [--repeats N] [--quick] [--json]
"""

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

# Two logical CPUs for the 2-replica runs; must precede any other TF use.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist import callbacks  # noqa: E402
from keras_safe_dist.audits import TrainingModeSnapshot  # noqa: E402
from keras_safe_dist.audits import aggregation_findings  # noqa: E402
from keras_safe_dist.audits import scope_findings  # noqa: E402

from _timing import no_collection  # noqa: E402

EPOCHS = 3


def _mlp(strategy, blocks, width):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((32,))
        x = inputs
        for _ in range(blocks):
            x = keras.layers.Dense(width, activation="relu")(x)
            x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Dropout(0.1)(x)
        model = SafeDistributedModel(inputs, keras.layers.Dense(10)(x))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _audits(log_dir):
    return [
        callbacks.ScopeAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.AggregationAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.TrainingModeAudit(log_dir=log_dir, on_finding="ignore"),
    ]


def _timed_fit(model, x, y, batch, cbs):
    with no_collection():
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=EPOCHS, verbose=0, callbacks=cbs)
        return time.perf_counter() - start


def bench_fit(repeats, quick):
    samples, batch = (1024, 64) if quick else (4096, 128)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 32)).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    rows = []
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for name, strategy in (("1 device", tf.distribute.get_strategy()), ("2 replicas", mirrored)):
        model = _mlp(strategy, blocks=2, width=256)
        with tempfile.TemporaryDirectory() as log_dir:
            times = {"without": [], "with audits": []}
            _timed_fit(model, x, y, batch, [])
            _timed_fit(model, x, y, batch, _audits(log_dir))
            for i in range(repeats):
                order = ["without", "with audits"][:: 1 if i % 2 == 0 else -1]
                for arm in order:
                    cbs = _audits(log_dir) if arm == "with audits" else []
                    times[arm].append(_timed_fit(model, x, y, batch, cbs))
        base = statistics.median(times["without"])
        audited = statistics.median(times["with audits"])
        rows.append(
            {
                "setting": name,
                "steps_per_epoch": samples // batch,
                "fit_without_s": base,
                "fit_with_audits_s": audited,
                "ratio": audited / base,
                "extra_per_epoch_ms": 1000 * (audited - base) / EPOCHS,
            }
        )
    return rows, mirrored


def bench_checks(strategy, repeats):
    model = _mlp(strategy, blocks=20, width=64)
    x = np.zeros((8, 32), "float32")
    model.fit(x, np.zeros((8,), "int32"), batch_size=4, epochs=1, verbose=0)
    checks = {
        "aggregation inventory": lambda: aggregation_findings(model),
        "scope check": lambda: scope_findings(model),
        "training-mode snapshot + compare": lambda: TrainingModeSnapshot(model).findings(),
    }
    variables = len(aggregation_findings(model)[1])
    results = {}
    for name, check in checks.items():
        check()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            check()
            times.append(time.perf_counter() - start)
        results[name] = 1000 * statistics.median(times)
    return {"variables": variables, "median_ms": results}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="timed fits per arm")
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    fit_rows, mirrored = bench_fit(repeats, args.quick)
    checks = bench_checks(mirrored, repeats)
    report = {"repeats": repeats, "epochs_per_fit": EPOCHS, "fit": fit_rows, "checks": checks}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"fit() of {EPOCHS} epochs, median of {repeats} interleaved runs")
    print("| setting | steps/epoch | without (s) | with audits (s) | ratio | extra per epoch (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in fit_rows:
        print(
            f"| {r['setting']} | {r['steps_per_epoch']} | {r['fit_without_s']:.3f} | "
            f"{r['fit_with_audits_s']:.3f} | {r['ratio']:.3f} | {r['extra_per_epoch_ms']:.1f} |"
        )
    print(f"\nEach check alone, 2 replicas, {checks['variables']} variables, median ms")
    print("| check | ms |")
    print("| --- | ---: |")
    for name, ms in checks["median_ms"].items():
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
