"""Where the host's time goes in a fit() on JAX: stock, safe, and safe with the detector.

On a GPU a step of about a millisecond is bound by the host, so a cost the
detector adds shows as host time. This script times, with `time.perf_counter`
around each call (no profiler: cProfile slows Python several times over and
moves the host's waits between functions), the parts of a `fit()` of one
epoch that differ between the three configurations:

- the train function Keras calls once per execution (the compiled step's
  dispatch, the batch's transfer, and with the detector the batch kept and
  the record taken out of the logs), and inside it the record's own parts;
- each callback hook of the detector and each per-fit call of the update
  engine;
- the whole `fit()`, waited for on the device.

Per configuration: the median over interleaved fits of each part's host time
per fit and per call. A part's time includes any wait for the device inside
it. Uses gpu_check's models (full size; `--quick`: smaller).

Usage, from the repository root (see gpu_check.py for a GPU's environment):
    PYTHONPATH=. python3 benchmarks/host_breakdown.py --models mlp,convnet
    Options: --fits N (interleaved fits per configuration, 15)
             --steps-per-execution N  --quick  --json PATH
"""

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check  # noqa: E402  (sets KERAS_BACKEND=jax before keras is imported)
import jax  # noqa: E402
import keras  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist.backend.jax import _update as _jax_update  # noqa: E402
from keras_safe_dist.backend.jax import nan_watch  # noqa: E402
from keras_safe_dist.backend.jax import trainer as _jax_trainer  # noqa: E402
from keras_safe_dist.callbacks import NaNOnsetDetector  # noqa: E402

from _timing import epoch_seconds  # noqa: E402

# (owner, method names): the calls timed, whichever configuration makes them.
TIMED = (
    (NaNOnsetDetector, (
        "on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end",
        "on_epoch_end", "on_train_end",
    )),
    (_jax_update.JAXUpdateEngine, ("begin_fit", "begin_epoch", "end_epoch")),
    (nan_watch.OnsetWatch, ("reset", "record_batch", "take", "read_with_weights")),
    (_jax_trainer.JAXTrainer, ("make_train_function",)),
)


class Timers:
    """Host seconds and calls per name, for the fit being timed."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()

    def wrap(self, name, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def take(self):
        taken = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return taken


def install(timers):
    for owner, names in TIMED:
        for name in names:
            setattr(owner, name, timers.wrap(f"{owner.__name__}.{name}", getattr(owner, name)))


def timed_train_function(model, timers):
    """Wraps the model's train function (Keras keeps it across fits once built)."""
    function = model.train_function
    if getattr(function, "_timed", False):
        return
    model.train_function = timers.wrap("train_function", function)
    model.train_function._timed = True


def one_fit(model, x, y, batch, callbacks, timers):
    seconds = epoch_seconds(model, x, y, batch, wait=gpu_check.wait, callbacks=callbacks)
    timed, calls = timers.take()
    timed["fit"], calls["fit"] = seconds, 1
    return timed, calls


def breakdown(name, quick, fits, steps_per_execution, timers):
    size = gpu_check.SIZES[name][quick]
    batch, full_steps, quick_steps = gpu_check.SPEED[name]
    steps = quick_steps if quick else full_steps
    x, y = gpu_check.data(name, size, batch * steps, seed=1)
    weights = gpu_check.initial_weights(name, size)
    configs = {
        "stock": (keras.Model, None),
        "safe": (SafeDistributedModel, None),
        "safe, detector": (SafeDistributedModel, NaNOnsetDetector),
    }
    models, callbacks = {}, {}
    for config, (model_class, callback) in configs.items():
        models[config] = gpu_check.build(name, size, model_class, "sgd", steps_per_execution)
        models[config].set_weights(weights)
        callbacks[config] = [callback()] if callback else None
        one_fit(models[config], x, y, batch, callbacks[config], timers)  # warm-up: compiles
        timed_train_function(models[config], timers)
    runs = {config: [] for config in configs}
    names = list(configs)
    for round_ in range(fits):
        shift = round_ % len(names)
        for config in names[shift:] + names[:shift]:
            runs[config].append(one_fit(models[config], x, y, batch, callbacks[config], timers))
    result = {"name": gpu_check.describe(name, size), "steps": steps, "batch": batch}
    for config, each in runs.items():
        parts = sorted({part for timed, _ in each for part in timed})
        result[config] = {
            part: {
                "us_per_fit": 1e6 * statistics.median(timed.get(part, 0.0) for timed, _ in each),
                "calls_per_fit": statistics.median(calls.get(part, 0) for _, calls in each),
            }
            for part in parts
        }
    return result


def table(report):
    lines = [
        f"device: {report['device']}; steps_per_execution={report['steps_per_execution']}; "
        f"{report['fits']} interleaved fits of one epoch per configuration; medians",
        f"{'model':<28} {'part':<44} {'stock':>18} {'safe':>18} {'safe, detector':>18}",
        f"{'':<28} {'':<44} " + " ".join(f"{'µs/fit (calls)':>18}" for _ in range(3)),
    ]
    for result in report["models"].values():
        configs = ("stock", "safe", "safe, detector")
        parts = sorted({part for config in configs for part in result[config]})
        parts.sort(key=lambda part: (part != "fit", part != "train_function", part))
        for part in parts:
            cells = []
            for config in configs:
                row = result[config].get(part)
                cells.append(
                    f"{row['us_per_fit']:>10.0f} ({row['calls_per_fit']:>4.0f})" if row else f"{'-':>18}"
                )
            lines.append(f"{result['name'][:28]:<28} {part:<44} " + " ".join(f"{c:>18}" for c in cells))
        steps = result["steps"]
        lines.append(
            f"{'':<28} {'(' + str(steps) + ' steps of ' + str(result['batch']) + ')':<44}"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,convnet")
    parser.add_argument("--fits", type=int, default=15)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in gpu_check.MODELS]
    if unknown or not models:
        parser.error(
            f"--models takes a comma-separated list of {', '.join(gpu_check.MODELS)}. "
            f"Received: {args.models!r}"
        )
    if args.fits < 1 or args.steps_per_execution < 1:
        parser.error(
            "--fits and --steps-per-execution must be integers >= 1. "
            f"Received: {args.fits}, {args.steps_per_execution}"
        )
    timers = Timers()
    install(timers)
    device = jax.devices()[0]
    report = {
        "device": f"{device.device_kind} ({device.platform})",
        "steps_per_execution": args.steps_per_execution,
        "fits": args.fits,
        "models": {},
    }
    for name in models:
        report["models"][name] = breakdown(
            name, args.quick, args.fits, args.steps_per_execution, timers
        )
        if args.json:
            with open(args.json, "w") as file:
                json.dump(report, file, indent=1)
    print(table(report))


if __name__ == "__main__":
    main()
