"""Exactness and speed of SafeDistributedModel against stock Keras on one JAX device.

Meant for one GPU in an environment with jax (CUDA), keras and tensorboard and
no TensorFlow; runs on a CPU too. For an MLP 64-256-256-10, a convnet (three
convolutions, global pooling) and a transformer block (token embedding,
multi-head self-attention, layer norms, feed-forward, pooled classifier),
against stock `keras.Model` on the same device:

1. Exactness: `||w_safe - w_ref|| / ||w_ref||` over all trainable weights after
   a few epochs, from the same initial weights and data order, where the
   reference is stock Keras at one batch of B per update and the safe model
   trains with `gradient_accumulation_steps=1` at batch B and with 4 at
   micro-batches of B/4; SGD and Adam (Adam at "highest" only with
   --quick), at JAX's default matmul precision and at "highest"
   (`jax.default_matmul_precision` around construction, compile and fit; the
   StableHLO of every module compiled meanwhile is scanned to count the
   matrix products and convolutions that carry HIGHEST: all of them at
   "highest", none at the default).
   Beside each cell, its controls, also stock Keras at batch B: a second
   identical run (`stock_repeat`: is stock reproducible on this device?) and
   a run with each batch's samples in reverse order (`stock_reordered`: what
   any re-split or re-ordering of the same samples does under this
   optimizer, the floor an accumulated run's figure sits on).
2. Stock's floor: stock Keras's gradient of one batch of B against the
   sample-weighted sum of the gradients of its 4 micro-batches, at the same
   weights (`jax.grad` over `stateless_call` and the compiled loss): the
   rounding any re-split of a batch causes, which accumulation cannot beat.
3. Speed: safe (`gradient_accumulation_steps=1`) against stock, epoch time,
   interleaved rounds after a warm-up epoch each, each epoch waited for on the
   device, each round's rotation run forward then backward (its epochs the
   mean of the two); the median of the rounds' ratios with a 95% bootstrap
   interval, and the difference of the median epochs per step.
4. `NaNOnsetDetector()` on a healthy run: safe with it against safe without
   (MLP and convnet).

`--deterministic` sets `--xla_gpu_deterministic_ops=true` in XLA_FLAGS before
jax starts (GPU: deterministic reductions and scatters; no effect on a CPU).
`--steps-per-execution N` compiles the timed models with it.

Synthetic data only (NumPy's generator); nothing is downloaded. One device,
no `keras.distribution`. Prints a table; `--json PATH` writes the figures as
strict JSON. Imports jax, keras, numpy, keras_safe_dist and the standard
library only, and says at the end whether `tensorflow` was imported: it exits
with status 1 if it was (a JAX user has no TensorFlow).

Usage, from the repository root:
    CPU, about 2 minutes on a 2-core VM (smaller models, fewer steps):
        PYTHONPATH=. python3 benchmarks/gpu_check.py --quick
    GPU (a few minutes, mostly compilation), with the keras wheel carried along
    (a pure-Python wheel, importable from the zip itself):
        PYTHONPATH=.:keras-3.15.1-py3-none-any.whl \\
            python3 benchmarks/gpu_check.py --json "$OUT/gpu_check.json"
    or after `python3 -m pip install --no-deps keras-3.15.1-py3-none-any.whl`:
        PYTHONPATH=. python3 benchmarks/gpu_check.py --json "$OUT/gpu_check.json"
    Options: --models mlp,convnet,transformer  --rounds N  --quick  --json PATH
             --deterministic  --steps-per-execution N  --only exactness|speed
             --profile (device time a step, by stream and kernel, from a
             jax.profiler trace of one epoch of each timed model)
             --host-profile (cProfile of one epoch of stock, safe and safe
             with the detector: the host's time a step, by function)
             --steps-scale N (N times the steps in each timed epoch: a
             cost that falls with N is paid per epoch, not per step)
             --controls (the safe model also with its global norm summed
             the other way, and with skip_nonfinite=False, in the same
             rotation against stock)
             --ablate (the detector also with each of its host-side parts
             left out, in the same rotation against the safe model: which
             part its cost is)
             --plain (a plain keras.Model with the detector against stock:
             the detector reads each step's loss there)
    The JSON is rewritten after each model, so a run stopped at a time limit
    keeps the models it finished.
"""

import argparse
import contextlib
import cProfile
import glob
import json
import math
import os
import platform
import pstats
import random
import shutil
import sys
import tempfile
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
if "--deterministic" in sys.argv[1:]:
    # Read when jax starts its backend: before jax is imported.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC_FLAG}".strip()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_safe_dist  # noqa: E402
from keras_safe_dist import SafeDistributedModel  # noqa: E402
from keras_safe_dist.backend.jax import _gradients as _jax_gradients  # noqa: E402
from keras_safe_dist.callbacks import NaNOnsetDetector  # noqa: E402

from _timing import interleave  # noqa: E402

MODELS = ("mlp", "convnet", "transformer")
PRECISIONS = ("default", "highest")
PARTS = 4  # micro-batches per update in the accumulated run
EXACT_BATCH = 256
# (optimizer, precision) of the exactness runs, (full, quick): each run
# compiles three train steps, most of a --quick run's time on a CPU.
EXACT_RUNS = (
    (("sgd", "default"), ("sgd", "highest"), ("adam", "default"), ("adam", "highest")),
    (("sgd", "default"), ("sgd", "highest"), ("adam", "highest")),
)
# (full, quick)
EXACT_EPOCHS = (3, 2)
UPDATES_PER_EPOCH = (8, 4)
ROUNDS = (21, 3)
# model: (full, quick) sizes and speed settings
SIZES = {
    "mlp": ({"features": 64, "width": 256}, {"features": 64, "width": 256}),
    "convnet": (
        {"side": 28, "channels": 1, "filters": (32, 64, 64)},
        {"side": 16, "channels": 1, "filters": (8, 16, 16)},
    ),
    "transformer": (
        {"vocab": 8000, "length": 64, "dim": 256, "heads": 4, "hidden": 512},
        {"vocab": 1000, "length": 16, "dim": 64, "heads": 4, "hidden": 128},
    ),
}
SPEED = {  # model: (batch, steps an epoch full, quick)
    "mlp": (64, 100, 20),
    "convnet": (256, 40, 4),
    "transformer": (64, 50, 10),
}
DETECTOR_MODELS = ("mlp", "convnet")
# --controls: the safe model's global norm summed the other way (concatenate?)
NORM_CONTROL = {True: "safe, joined norm", False: "safe, per-tensor norm"}
# --ablate: the rounds of one-execution fits, per timed round of epochs.
FIT_ROUNDS = 3
# --ablate: the detector with one of its host-side parts left out (name: parts).
ABLATIONS = {
    "detector, no batches kept": ("batches",),
    "detector, no checks": ("checks",),
    "detector, no epoch read": ("epoch_read",),
    "detector, step only": ("batches", "checks", "epoch_read"),
}


class AblatedDetector(NaNOnsetDetector):
    """A `NaNOnsetDetector` with some of its host-side parts left out, to time them.

    Args:
        leave_out: any of "batches" (the batches kept by reference for the
            replay), "checks" (the reads of the record every `check_every`
            steps), "epoch_read" (the record and the weights read at each
            epoch's end). The record kept in the compiled step stays.

    It no longer detects what those parts find: for timing only.
    """

    def __init__(self, leave_out):
        super().__init__()
        self.leave_out = frozenset(leave_out)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if "batches" in self.leave_out and self._watch is not None:
            self._watch.record_batch = lambda batch: None

    def on_train_batch_begin(self, batch, logs=None):
        if "checks" not in self.leave_out:
            super().on_train_batch_begin(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if "epoch_read" not in self.leave_out:
            super().on_epoch_end(epoch, logs)


def describe(model, size):
    if model == "mlp":
        return f"MLP {size['features']}-{size['width']}-{size['width']}-10"
    if model == "convnet":
        filters = "-".join(str(f) for f in size["filters"])
        return f"convnet {size['side']}x{size['side']}x{size['channels']}, {filters}"
    return (
        f"transformer {size['vocab']}x{size['dim']}, length {size['length']}, "
        f"{size['heads']} heads"
    )


def build(model, size, model_class, optimizer, steps_per_execution=1, **options):
    """One of `MODELS`, compiled with `optimizer` ("sgd" or "adam")."""
    if model == "mlp":
        inputs = keras.Input((size["features"],))
        hidden = keras.layers.Dense(size["width"], activation="relu")(inputs)
        hidden = keras.layers.Dense(size["width"], activation="relu")(hidden)
    elif model == "convnet":
        inputs = keras.Input((size["side"], size["side"], size["channels"]))
        hidden = inputs
        for filters in size["filters"]:
            hidden = keras.layers.Conv2D(filters, 3, activation="relu")(hidden)
        hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    else:
        inputs = keras.Input((size["length"],), dtype="int32")
        tokens = keras.layers.Embedding(size["vocab"], size["dim"])(inputs)
        attention = keras.layers.MultiHeadAttention(
            size["heads"], size["dim"] // size["heads"]
        )(tokens, tokens)
        hidden = keras.layers.LayerNormalization()(tokens + attention)
        forward = keras.layers.Dense(size["hidden"], activation="relu")(hidden)
        forward = keras.layers.Dense(size["dim"])(forward)
        hidden = keras.layers.LayerNormalization()(hidden + forward)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    result = model_class(inputs, keras.layers.Dense(10)(hidden), **options)
    result.compile(
        optimizer=keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
        steps_per_execution=steps_per_execution,
    )
    return result


def data(model, size, samples, seed=0):
    rng = np.random.default_rng(seed)
    if model == "mlp":
        x = rng.normal(size=(samples, size["features"])).astype("float32")
    elif model == "convnet":
        shape = (samples, size["side"], size["side"], size["channels"])
        x = rng.normal(size=shape).astype("float32")
    else:
        x = rng.integers(0, size["vocab"], size=(samples, size["length"])).astype("int32")
    return x, rng.integers(0, 10, size=samples).astype("int32")


def initial_weights(model, size):
    """The same initial weights in every run: Keras's initializers draw their
    seeds from Python's `random` (`keras.utils.set_random_seed` would import
    TensorFlow where it is installed)."""
    random.seed(0)
    return build(model, size, keras.Model, "sgd").get_weights()


def precision_scope(precision):
    if precision == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(precision)


@contextlib.contextmanager
def traced_precision(counts):
    """Counts the matrix products and convolutions in every module JAX compiles
    inside, and those at HIGHEST precision, into `counts` (from the StableHLO
    that `jax_dump_ir_to` writes)."""
    directory = tempfile.mkdtemp(prefix="gpu_check_ir_")
    jax.config.update("jax_dump_ir_to", directory)
    try:
        yield
    finally:
        jax.config.update("jax_dump_ir_to", "")
        for path in glob.glob(os.path.join(directory, "**", "*.mlir"), recursive=True):
            with open(path) as file:
                for line in file:
                    if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
                        counts["ops"] += 1
                        counts["highest"] += "HIGHEST" in line
        shutil.rmtree(directory, ignore_errors=True)


def flat(arrays):
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def reordered(x, y):
    """`x`, `y` with the samples of each batch of `EXACT_BATCH` in reverse order."""
    order = np.concatenate(
        [np.arange(i, min(i + EXACT_BATCH, len(x)))[::-1] for i in range(0, len(x), EXACT_BATCH)]
    )
    return x[order], y[order]


def exactness(model, size, weights, x, y, optimizer, precision, epochs):
    """Relative weight difference to stock at batch B: accumulation 1 and `PARTS`, and
    the controls (stock again, stock on each batch's samples re-ordered)."""
    results = {}
    with precision_scope(precision):

        def stock_run(x, y):
            stock = build(model, size, keras.Model, optimizer)
            stock.set_weights(weights)
            stock.fit(x, y, batch_size=EXACT_BATCH, epochs=epochs, verbose=0, shuffle=False)
            return flat(v.value for v in stock.trainable_variables)

        expected = stock_run(x, y)
        results["stock_repeat"] = relative(stock_run(x, y), expected)
        results["stock_reordered"] = relative(stock_run(*reordered(x, y)), expected)
        for steps in (1, PARTS):
            safe = build(
                model, size, SafeDistributedModel, optimizer, gradient_accumulation_steps=steps
            )
            safe.set_weights(weights)
            safe.fit(x, y, batch_size=EXACT_BATCH // steps, epochs=epochs, verbose=0, shuffle=False)
            received = flat(v.value for v in safe.trainable_variables)
            results[f"accumulation_{steps}"] = relative(received, expected)
    return results


def stock_floor(model, size, weights, x, y, precision):
    """Stock's gradient of one batch of B against the sample-weighted sum of its
    `PARTS` micro-batch gradients, relative norm of the difference."""
    with precision_scope(precision):
        stock = build(model, size, keras.Model, "sgd")
        stock.set_weights(weights)

        def loss(trainable, non_trainable, metrics, x, y):
            y_pred, non_trainable = stock.stateless_call(trainable, non_trainable, x, training=True)
            value, _ = stock.stateless_compute_loss(
                trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred, training=True
            )
            return value

        gradient = jax.jit(jax.grad(loss))
        state = [
            [v.value for v in variables]
            for variables in (
                stock.trainable_variables,
                stock.non_trainable_variables,
                stock.metrics_variables,
            )
        ]
        whole = flat(gradient(*state, x[:EXACT_BATCH], y[:EXACT_BATCH]))
        micro = EXACT_BATCH // PARTS
        summed = sum(
            (micro / EXACT_BATCH) * flat(gradient(*state, x[i : i + micro], y[i : i + micro]))
            for i in range(0, EXACT_BATCH, micro)
        )
    return relative(summed, whole)


def wait(model):
    """Waits for the steps `fit()` leaves running, inside the timed epoch."""
    jax.block_until_ready([variable.value for variable in model.variables])


def timing(configs, x, y, batch, rounds, callbacks=None):
    """`configs["other"]` against `configs["baseline"]`, and any further config
    (under "controls") against the same baseline, in one interleaved rotation."""
    timed = interleave(
        configs, "baseline", x, y, batch, rounds, wait=wait, callbacks=callbacks, balanced=True
    )
    base = timed["baseline"]

    def row(other):
        return {
            "batch": batch,
            "steps": other["steps"],
            "rounds": rounds,
            "baseline_epoch_ms": 1e3 * base["median_epoch_s"],
            "epoch_ms": 1e3 * other["median_epoch_s"],
            "ratio": other["median_ratio"],
            "ratio_interval": list(other["ratio_interval"]),
            "per_step_us": other["per_step_us"],
            # Each round's epoch (the mean of its two fits), for a second look.
            "baseline_rounds_ms": [1e3 * t for t in base["epoch_s"]],
            "rounds_ms": [1e3 * t for t in other["epoch_s"]],
        }

    result = row(timed["other"])
    controls = [name for name in configs if name not in ("baseline", "other")]
    if controls:
        result["controls"] = {name: row(timed[name]) for name in controls}
    return result


def compiled_with_norm(model, x, y, batch, concatenate):
    """Compiles `model`'s step with the global norm summed one way (see
    `_gradients.global_norm`), by one epoch; later fits keep that step."""
    _jax_gradients.NORM_BY_CONCATENATION = concatenate
    try:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        wait(model)
    finally:
        _jax_gradients.NORM_BY_CONCATENATION = None


def device_profile(configs, x, y, batch, callbacks=None):
    """Per config, the device's events a step in one traced epoch of a warm model.

    From a `jax.profiler` trace: for each line of the device planes (a GPU's
    streams, "XLA Modules", "XLA Ops"), the events and their microseconds a
    step, and the 12 kernels that take the most time on the streams. Empty on
    a platform whose trace has no device plane (a CPU).
    """
    callbacks = callbacks or {}
    profile = {}
    steps = -(-len(x) // batch)
    for name, model in configs.items():
        trace_dir = tempfile.mkdtemp()
        jax.profiler.start_trace(trace_dir)
        try:
            model.fit(
                x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                callbacks=callbacks.get(name),
            )
            wait(model)
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        lines, kernels, intervals = {}, {}, []
        for plane in jax.profiler.ProfileData.from_file(paths[0]).planes if paths else ():
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                row = lines.setdefault(line.name, {"events": 0, "us": 0.0})
                for event in line.events:
                    row["events"] += 1
                    row["us"] += event.duration_ns / 1e3
                    if line.name.startswith("Stream") and hasattr(event, "start_ns"):
                        intervals.append((event.start_ns, event.start_ns + event.duration_ns))
                        kernel = kernels.setdefault(event.name[:120], {"events": 0, "us": 0.0})
                        kernel["events"] += 1
                        kernel["us"] += event.duration_ns / 1e3
        shutil.rmtree(trace_dir, ignore_errors=True)
        per_step = lambda row: {key: value / steps for key, value in row.items()}  # noqa: E731
        top = sorted(kernels.items(), key=lambda item: -item[1]["us"])[:12]
        profile[name] = {
            "lines": {key: per_step(row) for key, row in lines.items()},
            "top_kernels": {key: per_step(row) for key, row in top},
            "streams": per_step(busy_and_span(intervals)),
        }
    return profile


def host_profile(configs, x, y, batch, callbacks=None, top=24):
    """Per config, where the host's time goes in one epoch of a warm model.

    `cProfile` over one `fit()` of one epoch: the functions with the most
    cumulative time a step, among this package's and Keras's callback and
    loop functions (names shortened to file:line:function), and the epoch's
    seconds under the profiler. cProfile slows Python several times over:
    compare configs with each other, not with the timed epochs. On Python
    3.12 it also sees Keras's callback thread, and may leave out the outer
    `fit()`: compare runs of one Python only.
    """
    callbacks = callbacks or {}
    steps = -(-len(x) // batch)
    profile = {}
    for name, model in configs.items():
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        model.fit(
            x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
            callbacks=callbacks.get(name),
        )
        wait(model)
        profiler.disable()
        seconds = time.perf_counter() - start
        rows = []
        for (path, line, function), (_, calls, _, cumulative, _) in pstats.Stats(profiler).stats.items():
            if "keras_safe_dist" in path or "callbacks" in path or "trainer" in path:
                short = f"{os.path.basename(path)}:{line}:{function}"
                rows.append((short, 1e6 * cumulative / steps, calls / steps))
        rows.sort(key=lambda row: -row[1])
        profile[name] = {
            "epoch_s": seconds,
            "top": [{"function": f, "us_per_step": us, "calls_per_step": c} for f, us, c in rows[:top]],
        }
    return profile


def diagnostic(function, *args, **kwargs):
    """`function(*args, **kwargs)`, or `{"error": ...}` when it raises."""
    try:
        return function(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a diagnostic must not lose the figures
        print(f"({function.__name__} failed: {type(error).__name__}: {error})", flush=True)
        return {"error": f"{type(error).__name__}: {error}"}


def busy_and_span(intervals):
    """Microseconds the streams ran a kernel (the union of the kernels' intervals)
    and from the first kernel's start to the last one's end; the rest of the
    span the device waited, for the host or between kernels."""
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = max(stop for _, stop in intervals) - min(start for start, _ in intervals) if intervals else 0
    return {"busy_us": busy / 1e3, "span_us": span / 1e3}


def check(
    model,
    quick,
    rounds,
    steps_per_execution=1,
    parts=("exactness", "speed"),
    profile=False,
    controls=False,
    steps_scale=1,
    profile_host=False,
    ablate=False,
    plain=False,
):
    start = time.perf_counter()
    size = SIZES[model][quick]
    weights = initial_weights(model, size)
    epochs = EXACT_EPOCHS[quick]
    x, y = data(model, size, EXACT_BATCH * UPDATES_PER_EPOCH[quick])
    result = {"name": describe(model, size), "exactness": {}, "floor": {}, "traced": {}}
    for optimizer, precision in EXACT_RUNS[quick] if "exactness" in parts else ():
        counts = result["traced"].setdefault(precision, {"ops": 0, "highest": 0})
        with traced_precision(counts):
            result["exactness"].setdefault(optimizer, {})[precision] = exactness(
                model, size, weights, x, y, optimizer, precision, epochs
            )
    for precision in PRECISIONS if "exactness" in parts else ():
        result["floor"][precision] = stock_floor(model, size, weights, x, y, precision)
    result["exactness_seconds"] = time.perf_counter() - start
    if "speed" not in parts:
        result["seconds"] = time.perf_counter() - start
        return result

    batch, full_steps, quick_steps = SPEED[model]
    steps = (quick_steps if quick else full_steps) * steps_scale
    x, y = data(model, size, batch * steps, seed=1)
    models = {
        "stock": build(model, size, keras.Model, "sgd", steps_per_execution),
        "safe": build(model, size, SafeDistributedModel, "sgd", steps_per_execution),
    }
    configs = {"baseline": models["stock"], "other": models["safe"]}
    if controls:
        # The safe model with its global norm summed the other way than this
        # platform's default, and without the norm and the skip.
        concatenate = not _jax_gradients.joins_norm(
            [v.value for v in models["safe"].trainable_variables]
        )
        models[NORM_CONTROL[concatenate]] = build(
            model, size, SafeDistributedModel, "sgd", steps_per_execution
        )
        models["safe, skip_nonfinite=False"] = build(
            model, size, SafeDistributedModel, "sgd", steps_per_execution, skip_nonfinite=False
        )
    for each in models.values():
        each.set_weights(weights)
    if controls:
        compiled_with_norm(models[NORM_CONTROL[concatenate]], x, y, batch, concatenate)
        for name in (NORM_CONTROL[concatenate], "safe, skip_nonfinite=False"):
            configs[name] = models[name]
    result["speed"] = timing(configs, x, y, batch, rounds)
    if model in DETECTOR_MODELS:
        detector = NaNOnsetDetector()
        models["safe, detector"] = build(
            model, size, SafeDistributedModel, "sgd", steps_per_execution
        )
        models["safe, detector"].set_weights(weights)
        configs = {"baseline": models["safe"], "other": models["safe, detector"]}
        callbacks = {"other": [detector]}
        for name, parts in ABLATIONS.items() if ablate else ():
            configs[name] = build(model, size, SafeDistributedModel, "sgd", steps_per_execution)
            configs[name].set_weights(weights)
            callbacks[name] = [AblatedDetector(parts)]
        result["detector"] = timing(configs, x, y, batch, rounds, callbacks=callbacks)
        result["detector"]["onset_reported"] = detector.report is not None
        if ablate:
            # What the detector costs a fit() whatever its length: fits of one
            # execution, in their own rotation (its "per step" is per fit).
            # The epoch's cost less this, over its steps, is the per-step cost.
            one = batch * steps_per_execution
            result["detector_per_fit"] = timing(
                {"baseline": models["safe"], "other": models["safe, detector"]},
                x[:one],
                y[:one],
                batch,
                FIT_ROUNDS * rounds,
                callbacks={"other": [detector]},
            )
    if plain and model in DETECTOR_MODELS:
        # A plain keras.Model keeps no record in its step: the detector reads
        # each step's logged loss (docs/nan_detector.md), and this is its cost.
        models["stock, detector"] = build(model, size, keras.Model, "sgd", steps_per_execution)
        models["stock, detector"].set_weights(weights)
        result["plain_detector"] = timing(
            {"baseline": models["stock"], "other": models["stock, detector"]},
            x,
            y,
            batch,
            rounds,
            callbacks={"other": [NaNOnsetDetector()]},
        )
    # The diagnostics after the figures, the host's first: on an H200 one
    # run's cProfiled epochs, after a jax.profiler trace of the same models,
    # failed in the compiled step (CUDA_ERROR_LAUNCH_FAILED), and took the
    # timed figures with them. A failure now is recorded beside them.
    if profile_host:
        result["host_profile"] = diagnostic(
            host_profile,
            {name: models[name] for name in ("stock", "safe", "safe, detector") if name in models},
            x,
            y,
            batch,
            callbacks={"safe, detector": [NaNOnsetDetector()]},
        )
    if profile:
        result["profile"] = diagnostic(
            device_profile, models, x, y, batch, callbacks={"safe, detector": [NaNOnsetDetector()]}
        )
    result["seconds"] = time.perf_counter() - start
    return result


def finite(value):
    """`value` with non-finite floats as None, for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def write_json(path, report):
    text = json.dumps(finite(report), indent=1, allow_nan=False)
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        file.write(text + "\n")
    os.replace(partial, path)  # whole or not at all


def table(report):
    device = report["device"]
    lines = [
        f"device: {device['kind']} ({device['platform']}), {device['count']} device(s); "
        f"jax {report['versions']['jax']}, keras {report['versions']['keras']}"
        + ("; --quick" if report["quick"] else "")
        + ("; deterministic ops" if report["deterministic_ops"] else "")
        + f"; steps_per_execution={report['steps_per_execution']}",
        "",
        f"exactness: ||w_safe - w_stock|| / ||w_stock|| after {report['exact_epochs']} epochs "
        f"of {report['updates_per_epoch']} updates; stock at batch {EXACT_BATCH}; "
        f"floor: stock's gradient, {EXACT_BATCH} vs {PARTS}x{EXACT_BATCH // PARTS}",
        f"{'model':<44} {'precision':<9} "
        + " ".join(f"{label:>10}" for label in CELL_LABELS)
        + f" {'floor':>9} {'HIGHEST ops':>12}",
        "(k: gradient_accumulation_steps; again: stock run twice; order: stock on each "
        "batch re-ordered; HIGHEST ops: matrix products and convolutions compiled at "
        "HIGHEST / all compiled in those runs)",
    ]
    for result in report["models"].values():
        for precision in PRECISIONS if result["floor"] else ():
            cells = [
                result["exactness"].get(optimizer, {}).get(precision, {}).get(key)
                for optimizer in ("sgd", "adam")
                for key in CELL_KEYS
            ]
            traced = result["traced"][precision]
            lines.append(
                f"{result['name']:<44} {precision:<9} "
                + " ".join(f"{'-':>10}" if cell is None else f"{cell:>10.2e}" for cell in cells)
                + f" {result['floor'][precision]:>9.2e}"
                + f" {str(traced['highest']) + '/' + str(traced['ops']):>12}"
            )
    lines += [
        "",
        "speed: epoch-time ratio, median of interleaved rounds (95% interval); per step: "
        "difference of the median epochs over their steps (one-execution fits: per fit)",
        f"{'model':<44} {'compared':<36} {'batch':>5} {'steps':>5} {'rounds':>6} "
        f"{'base ms':>8} {'ms':>8} {'ratio':>6} {'interval':>13} {'per step':>9}",
    ]
    for result in report["models"].values():
        rows = []
        for key, label, base in (
            ("speed", "safe / stock", "stock"),
            ("detector", "detector / safe", "safe"),
            ("detector_per_fit", "detector / safe, one-execution fit", "safe"),
            ("plain_detector", "plain model: detector / stock", "stock"),
        ):
            if key in result:
                per_fit = key == "detector_per_fit"
                rows.append((label, result[key], per_fit))
                for name, control in result[key].get("controls", {}).items():
                    rows.append((f"{name} / {base}", control, per_fit))
        for label, row, per_fit in rows:
            low, high = row["ratio_interval"]
            cost = (
                f"{row['per_step_us'] * row['steps']:>+7.0f}µs/fit"
                if per_fit
                else f"{row['per_step_us']:>+7.0f}µs"
            )
            lines.append(
                f"{result['name']:<44} {label:<36} {row['batch']:>5} {row['steps']:>5} "
                f"{row['rounds']:>6} {row['baseline_epoch_ms']:>8.1f} {row['epoch_ms']:>8.1f} "
                f"{row['ratio']:>6.3f} {f'{low:.3f}-{high:.3f}':>13} {cost}"
            )
    for result, config, profile in diagnostics(report, "profile", "profile", lines):
        streams = [row for line, row in profile["lines"].items() if line.startswith("Stream")]
        lines.append(
            f"profile {result['name']}, {config}: "
            + ", ".join(
                f"{line} {row['events']:.1f} events {row['us']:.1f} µs"
                for line, row in profile["lines"].items()
            )
            + f"; streams: {sum(row['events'] for row in streams):.1f} kernels, "
            f"{sum(row['us'] for row in streams):.1f} µs a step, busy "
            f"{profile['streams']['busy_us']:.1f} of {profile['streams']['span_us']:.1f} µs"
        )
    for result, config, profile in diagnostics(report, "host_profile", "host profile", lines):
        lines.append(
            f"host profile {result['name']}, {config} (epoch {profile['epoch_s'] * 1e3:.1f} ms "
            "under cProfile): "
            + "; ".join(
                f"{row['function']} {row['us_per_step']:.1f} µs x{row['calls_per_step']:.2f}"
                for row in profile["top"]
            )
        )
    lines += ["", f"tensorflow imported: {report['tensorflow_imported']}"]
    return "\n".join(lines)


def diagnostics(report, key, label, lines):
    """`(model's result, config, profile)` of each model's diagnostic `key`; a
    failed one is a line of `lines` instead."""
    for result in report["models"].values():
        for config, profile in result.get(key, {}).items():
            if config == "error":
                lines.append(f"{label} {result['name']}: failed ({profile})")
            else:
                yield result, config, profile


CELL_KEYS = ("accumulation_1", f"accumulation_{PARTS}", "stock_repeat", "stock_reordered")
CELL_LABELS = tuple(
    f"{optimizer} {label}"
    for optimizer in ("SGD", "Adam")
    for label in ("k=1", f"k={PARTS}", "again", "order")
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (21; quick: 3)")
    parser.add_argument("--json", metavar="PATH", help="write the figures there as JSON")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help=f"XLA_FLAGS {DETERMINISTIC_FLAG} (read before jax starts)",
    )
    parser.add_argument("--steps-per-execution", type=int, default=1, help="of the timed models")
    parser.add_argument(
        "--only", choices=("exactness", "speed"), help="run one part (default: both)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="trace one epoch of each timed model; device time a step, by stream and kernel",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile one epoch of stock, safe and safe with the detector: host time a step",
    )
    parser.add_argument(
        "--steps-scale",
        type=int,
        default=1,
        help="times more steps in each timed epoch (a cost that falls with it is per epoch)",
    )
    parser.add_argument(
        "--controls",
        action="store_true",
        help="also time the safe model with its global norm summed the other way "
        "(per tensor, or over the joined gradients) and with skip_nonfinite=False",
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="also time the detector with each of its host-side parts left out "
        "(the batches kept, the checks, the epoch's read), against the safe model",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also time a plain keras.Model with the detector against the same without "
        "(the detector reads each step's loss there)",
    )
    args = parser.parse_args(argv)
    if args.steps_scale < 1:
        parser.error(f"--steps-scale must be an integer >= 1. Received: {args.steps_scale}")
    if args.steps_per_execution < 1:
        parser.error(
            "--steps-per-execution must be an integer >= 1. "
            f"Received: {args.steps_per_execution}"
        )
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in MODELS]
    if unknown or not models:
        parser.error(
            f"--models takes a comma-separated list of {', '.join(MODELS)}. "
            f"Received: {args.models!r}"
        )
    rounds = args.rounds if args.rounds is not None else ROUNDS[args.quick]
    if rounds < 1:
        parser.error(f"--rounds must be an integer >= 1. Received: {rounds}")

    start = time.perf_counter()
    device = jax.devices()[0]
    report = {
        "device": {
            "kind": device.device_kind,
            "platform": device.platform,
            "count": len(jax.devices()),
        },
        "versions": {
            "jax": jax.__version__,
            "keras": keras.__version__,
            "keras_safe_dist": keras_safe_dist.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "quick": args.quick,
        "exact_batch": EXACT_BATCH,
        "micro_batches": PARTS,
        "exact_epochs": EXACT_EPOCHS[args.quick],
        "updates_per_epoch": UPDATES_PER_EPOCH[args.quick],
        "deterministic_ops": DETERMINISTIC_FLAG in os.environ.get("XLA_FLAGS", ""),
        "steps_per_execution": args.steps_per_execution,
        "controls": args.controls,
        "steps_scale": args.steps_scale,
        "ablate": args.ablate,
        "plain": args.plain,
        "models": {},
    }
    for name in models:
        report["models"][name] = check(
            name,
            args.quick,
            rounds,
            args.steps_per_execution,
            parts=(args.only,) if args.only else ("exactness", "speed"),
            profile=args.profile,
            controls=args.controls,
            steps_scale=args.steps_scale,
            profile_host=args.host_profile,
            ablate=args.ablate,
            plain=args.plain,
        )
        print(f"({name}: {report['models'][name]['seconds']:.0f} s)", flush=True)
        if args.json:
            # Each model's figures as they come: a run stopped at its time
            # limit keeps the models it finished.
            write_json(args.json, {**report, "tensorflow_imported": "tensorflow" in sys.modules})
    report["seconds"] = time.perf_counter() - start
    report["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    report["tensorflow_imported"] = "tensorflow" in sys.modules
    print(table(report))
    load = report["load_average"]
    print(f"({report['seconds']:.0f} s" + (f", load average {load[0]:.1f})" if load else ")"))
    if args.json:
        write_json(args.json, report)
    if report["tensorflow_imported"]:
        sys.exit("tensorflow was imported (expected: not, a JAX user has no TensorFlow).")


if __name__ == "__main__":
    main()
