"""Host cost per step on JAX: models small enough that the host's work sets the pace.

On a GPU a step of about a millisecond is as fast as the host can dispatch
it: every host read, eager operation or Python line per step shows. A CPU
sees the same costs on a model whose step is mostly dispatch: a Dense(1) at
batch 8 (stock: about 130 microseconds a step on a 2-core VM). This
benchmark times, on one JAX CPU device (as on one GPU), epochs of

- `Dense(1)` at batch 8: stock `keras.Model`, `SafeDistributedModel`, and
  `SafeDistributedModel` with a `NaNOnsetDetector`;
- the MLP 64-256-256-10 at batch 64 (bench_model.py's): the same three;
- the same MLP fitted on one batch: each epoch is a `fit()` of one step, so
  its "per step" is the host's work per `fit()` (checks, callbacks, the
  update engine's calls at a fit's and an epoch's start and end), which a
  short epoch on a GPU (gpu_check.py's 40 to 100 steps) pays in full.

Rounds of one epoch per configuration in rotating order (interleaved), after
a warm-up epoch; per model, the median of each round's ratio to stock (and
to the safe model for the detector) with its 95% bootstrap interval, and
the per-step cost against the reference in microseconds. It also counts the
computations each configuration launches per step, from a `jax.profiler`
trace (stock: 1). Prints a table, or JSON with `--json`.

On a CPU Keras feeds the step the host arrays; on an accelerator it places
each batch on the device one step ahead. `--accelerator-feeding` makes Keras
feed the CPU device as it feeds an accelerator, so that what the device
batches cost the host (the NaN detector's kept batches, for one) shows here.

Usage:
    python benchmarks/bench_dispatch.py [--rounds 21] [--steps-per-execution 1]
        [--accelerator-feeding] [--json]
"""

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist.callbacks import NaNOnsetDetector  # noqa: E402

from _timing import interleave  # noqa: E402
from _timing import median_interval  # noqa: E402

# name: (features, hidden widths, outputs, samples, batch size)
MODELS = {
    "Dense(1)": (4, (), 1, 3200, 8),
    "MLP 64-256-256-10": (64, (256, 256), 10, 6400, 64),
    "MLP 64-256-256-10, one-step fits": (64, (256, 256), 10, 64, 64),
}
CONFIGS = ("stock", "safe", "safe + NaNOnsetDetector")


def _model(name, model_class, steps_per_execution):
    features, widths, outputs, _, _ = MODELS[name]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    hidden = inputs
    for width in widths:
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
    model = model_class(inputs, keras.layers.Dense(outputs)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=steps_per_execution
    )
    return model


def _data(name):
    features, _, outputs, samples, batch = MODELS[name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.normal(size=(samples, outputs)).astype("float32")
    return x, y, batch


def _wait(model):
    jax.block_until_ready([v.value for v in model.variables])


def _launches_per_step(model, x, y, batch, callbacks):
    """Computations launched per step in one traced epoch (a warm model)."""
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir)
    try:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
        _wait(model)
    finally:
        jax.profiler.stop_trace()
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    counts = collections.Counter(
        event.name for plane in data.planes for line in plane.lines for event in line.events
    )
    return counts["CommonPjRtLoadedExecutable::ExecutePrepare"] / -(-len(x) // batch)


def bench(rounds, steps_per_execution):
    results = {}
    for name in MODELS:
        x, y, batch = _data(name)
        configs = {
            "stock": _model(name, keras.Model, steps_per_execution),
            "safe": _model(name, SafeDistributedModel, steps_per_execution),
            "safe + NaNOnsetDetector": _model(name, SafeDistributedModel, steps_per_execution),
        }
        callbacks = {"safe + NaNOnsetDetector": [NaNOnsetDetector()]}
        timed = interleave(configs, "stock", x, y, batch, rounds, wait=_wait, callbacks=callbacks)
        safe, detector = timed["safe"]["epoch_s"], timed["safe + NaNOnsetDetector"]["epoch_s"]
        ratios = [d / s for d, s in zip(detector, safe)]
        steps = timed["stock"]["steps"]
        timed["safe + NaNOnsetDetector"]["ratio_to_safe"] = float(np.median(ratios))
        timed["safe + NaNOnsetDetector"]["ratio_to_safe_interval"] = median_interval(ratios)
        timed["safe + NaNOnsetDetector"]["per_step_us_over_safe"] = (
            1e6 * (float(np.median(detector)) - float(np.median(safe))) / steps
        )
        for config, model in configs.items():
            timed[config]["launches_per_step"] = _launches_per_step(
                model, x, y, batch, callbacks.get(config)
            )
            timed[config]["step_us"] = 1e6 * timed[config]["median_epoch_s"] / steps
        results[f"{name}, batch {batch}"] = timed
    return {
        "results": results,
        "rounds": rounds,
        "steps_per_execution": steps_per_execution,
        "device": str(jax.devices()[0]),
        "versions": {"jax": jax.__version__, "keras": keras.__version__},
        "load_average": os.getloadavg(),
    }


def table(report):
    lines = [
        f"jax {report['versions']['jax']}, keras {report['versions']['keras']}, "
        f"{report['device']}, {report['rounds']} rounds, "
        f"steps_per_execution={report['steps_per_execution']}"
        + (", fed as an accelerator" if report.get("accelerator_feeding") else ""),
        "",
        "| model | configuration | step | ratio (95% interval) | per step | launches per step |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for model, rows in report["results"].items():
        for config in CONFIGS:
            row = rows[config]
            if config == "stock":
                ratio, cost = "1", "-"
            elif config == "safe":
                low, high = row["ratio_interval"]
                ratio = f"{row['median_ratio']:.3f} ({low:.3f}-{high:.3f}) of stock"
                cost = f"{row['per_step_us']:+.1f} µs"
            else:
                low, high = row["ratio_to_safe_interval"]
                ratio = f"{row['ratio_to_safe']:.3f} ({low:.3f}-{high:.3f}) of safe"
                cost = f"{row['per_step_us_over_safe']:+.1f} µs"
            lines.append(
                f"| {model} | {config} | {row['step_us']:.0f} µs | {ratio} | {cost} | "
                f"{row['launches_per_step']:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (default 21)")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument(
        "--accelerator-feeding",
        action="store_true",
        help="Keras places each batch on the device one step ahead, as on an accelerator",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.accelerator_feeding:
        # Keras's JAX epoch iterator feeds host arrays where the default backend is "cpu".
        jax.default_backend = lambda: "gpu"
    report = bench(args.rounds, args.steps_per_execution)
    report["accelerator_feeding"] = args.accelerator_feeding
    print(json.dumps(report) if args.json else table(report))


if __name__ == "__main__":
    main()
