"""Designs of the NaN detector's in-step checks that were measured and not kept,
timed against the design in use on the same model.

`bench_nan_onset.py` times the detector as it ships. This script times, on one
device, several variants of `SafeDistributedModel.train_step` with the detector,
each traced on the same model and timed in rotation (blocks of a few steps, the
same per-batch path as that benchmark's "steps" rows), with several traces of
"no detector" and "detector": traces of the same step differ by a percent or
two, so a variant's figure is only meaningful against that spread.

Variants without XLA:
- "flags compiled": the flags computed in a small XLA-compiled function of their
  own, called from the plain step.
- "flags and weights compiled": the same, with the weights' terms inside it.

Variants with `--xla` (the model compiled with `jit_compile=True`):
- "no capture, no weight check": the flags inside the compiled step, nothing
  beside it: what the detector's structure costs on its own.
- "weights inside XLA": the weights' terms taken inside the compiled step.
- "weights after the update": inside the compiled step, read after the update.
- "weights beside XLA": the weights' terms taken before the compiled step as in
  use, but the compiled step does not wait for them: they run beside it.

Prints, per variant and trace, the median ms per step and the median paired
ratio over the first "no detector" trace with a 90% bootstrap interval.

Usage:
    PYTHONPATH=. python benchmarks/bench_nan_variants.py [--model small|medium] [--xla]
        [--one-core] [--rotations N] [--block N] [--traces N] [--json]
"""

import argparse
import json
import os
import statistics
import sys

if "--one-core" in sys.argv:  # before TensorFlow sizes its thread pools
    if not hasattr(os, "sched_setaffinity"):
        sys.exit("--one-core needs os.sched_setaffinity, which this platform lacks (Linux has it).")
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_safe_dist import _nan_probe  # noqa: E402
from keras_safe_dist.callbacks import NaNOnsetDetector  # noqa: E402
from keras_safe_dist.model import SafeDistributedFunctional  # noqa: E402

from bench_nan_onset import _STEP_STATE  # noqa: E402
from bench_nan_onset import BATCH  # noqa: E402
from bench_nan_onset import MODELS  # noqa: E402
from bench_nan_onset import _dataset  # noqa: E402
from bench_nan_onset import _model  # noqa: E402
from bench_nan_onset import _timed_steps  # noqa: E402


def _capture(probe, data):
    """The batch capture of `NaNProbe.begin_step`, without the weights' terms."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    for variable, value in zip(probe.capture or [], keras.tree.flatten((x, y, sample_weight))):
        if variable is not None:
            variable.assign(value, read_value=False)


def _weight_terms(model):
    return _nan_probe._tensor_terms(_nan_probe._floating(model.trainable_weights))


def _compiled(model, name, function):
    """`function` compiled with XLA, kept on the model (past Keras's tracking)."""
    functions = model.__dict__.setdefault("_variant_functions", {})
    if name not in functions:
        functions[name] = tf.function(function, jit_compile=True, reduce_retracing=True)
    return functions[name]


def _compiled_logs(with_weights):
    """A `NaNProbe.logs` whose flags come from one XLA-compiled function."""

    def logs(probe, data, loss_numerator, grads, weight_terms):
        inputs = [t for t in keras.tree.flatten(data) if t is not None and t.dtype.is_floating]

        def flags(loss_numerator, inputs, weight_terms):
            inputs = [_nan_probe._input_term(t) for t in inputs]
            if with_weights:
                weight_terms = _weight_terms(probe.model)
            groups = [[tf.cast(loss_numerator, tf.float32)] + inputs, inputs, list(weight_terms)]
            return _nan_probe._nonfinite_sum(groups, probe._scales(), probe.dtype)

        function = _compiled(probe.model, f"flags {with_weights}", flags)
        return {"nonfinite_replicas": function(loss_numerator, inputs, weight_terms)}

    return logs


def _flags_compiled(model, data, with_weights=False):
    probe = model._nan_probe
    probe.logs = _compiled_logs(with_weights).__get__(probe)
    if with_weights:
        _capture(probe, data)
        return model._step(data)
    return model._step(data, probe.begin_step(data))


def _no_capture_no_weights(model, data):
    return model._xla_step(data)


def _weights_inside_xla(model, data):
    _capture(model._nan_probe, data)
    step = _compiled(model, "inside", lambda data: model._step(data, _weight_terms(model)))
    return step(data)


def _weights_after_update(model, data):
    _capture(model._nan_probe, data)

    def step(data):
        logs = model._step(data)
        with tf.control_dependencies(list(logs.values())):
            terms = _weight_terms(model)
        return model._nan_probe.with_weight_flags(logs, terms)

    return _compiled(model, "after", step)(data)


def _weights_beside_xla(model, data):
    probe = model._nan_probe
    terms = probe.begin_step(data)
    return probe.with_weight_flags(model._xla_step(data), terms)


# name: (the train step, or None for the model's own; whether the detector is on)
VARIANTS = {
    "no detector": (None, False),
    "detector": (None, True),
    "flags compiled": (_flags_compiled, True),
    "flags and weights compiled": (lambda m, d: _flags_compiled(m, d, with_weights=True), True),
}
XLA_VARIANTS = {
    "no detector": (None, False),
    "detector": (None, True),
    "no capture, no weight check": (_no_capture_no_weights, True),
    "weights inside XLA": (_weights_inside_xla, True),
    "weights after the update": (_weights_after_update, True),
    "weights beside XLA": (_weights_beside_xla, True),
}


class VariantModel(SafeDistributedFunctional):
    """A `SafeDistributedModel` whose train step is the variant being traced."""

    def train_step(self, data):
        step = self.__dict__.get("_variant_step")
        return super().train_step(data) if step is None else step(self, data)


def bench_variants(model_name, xla, rotations, block, traces):
    """{(variant, trace): [seconds per step of each timed block]}."""
    features, width, samples = MODELS[model_name]
    dataset = _dataset(samples, features)
    model = _model(tf.distribute.get_strategy(), features, width, xla, model_class=VariantModel)
    variants = XLA_VARIANTS if xla else VARIANTS
    runs = [
        (name, trace)
        for name in variants
        for trace in range(traces if name in ("no detector", "detector") else 1)
    ]
    states, callbacks = {}, {}
    for name, trace in runs:
        step, detector = variants[name]
        model.__dict__["_variant_step"] = step
        model.train_function = None  # a fresh trace
        callbacks[name, trace] = [NaNOnsetDetector()] if detector else []
        model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=callbacks[name, trace])
        states[name, trace] = {a: getattr(model, a) for a in _STEP_STATE}
    iterator = iter(tf.distribute.get_strategy().experimental_distribute_dataset(dataset.repeat()))
    times = {run: [] for run in runs}
    for rotation in range(rotations):
        shift = rotation % len(runs)
        for run in runs[shift:] + runs[:shift]:
            for attribute, value in states[run].items():
                setattr(model, attribute, value)
            times[run].append(_timed_steps(model, iterator, callbacks[run], block))
    return times


def summary(times, seed=0):
    """Rows of median ms per step and median paired ratio to the first "no detector"
    trace, with a 90% bootstrap interval of that median."""
    rng = np.random.default_rng(seed)
    base = times["no detector", 0]
    rows = []
    for (name, trace), values in times.items():
        paired = np.array(values) / np.array(base)
        medians = [np.median(rng.choice(paired, len(paired))) for _ in range(2000)]
        rows.append(
            {
                "variant": name,
                "trace": trace,
                "ms": statistics.median(values) * 1e3,
                "paired_ratio": float(np.median(paired)),
                "interval": [float(np.percentile(medians, 5)), float(np.percentile(medians, 95))],
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "medium"], default="small")
    parser.add_argument("--xla", action="store_true", help="compile the step with XLA")
    parser.add_argument(
        "--one-core", action="store_true", help="pin this process to one CPU core (Linux)"
    )
    parser.add_argument("--rotations", type=int, default=150, help="timed blocks per trace")
    parser.add_argument("--block", type=int, default=8, help="steps per timed block")
    parser.add_argument(
        "--traces", type=int, default=2, help='traces of "no detector" and of "detector"'
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    for name in ("rotations", "block", "traces"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1. Received: --{name}={getattr(args, name)}")
    model_name = f"{args.model} MLP"
    times = bench_variants(model_name, args.xla, args.rotations, args.block, args.traces)
    rows = summary(times)
    if args.json:
        print(json.dumps({"setup": vars(args), "batch": BATCH, "rows": rows}))
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    where = "one core" if args.one_core else f"{cores} cores"
    print(
        f"{model_name}, {'XLA' if args.xla else 'no XLA'}, {where}: {args.rotations} "
        f"blocks of {args.block} steps per trace, batch {BATCH}"
    )
    print(f"{'variant':<30}{'trace':>6}{'ms/step':>10}{'paired ratio':>14}  90% interval")
    for row in rows:
        low, high = row["interval"]
        print(
            f"{row['variant']:<30}{row['trace']:>6}{row['ms']:>10.3f}"
            f"{row['paired_ratio']:>14.3f}  [{low:.3f}, {high:.3f}]"
        )


if __name__ == "__main__":
    main()
