"""The JAX half of bench_model.py: `SafeDistributedModel` against stock Keras on JAX.

Run by `bench_model.py --backend jax` in a process of its own (the backend and
the device count are fixed at import): two CPU devices under
`keras.distribution.DataParallel`, batches the devices divide, the MLP
64-256-256-10 at batch 64 and bench_model.py's convnet, each compiled with
`jit_compile=True` (Keras's default on JAX). Same method as the TensorFlow
sections: a warm-up epoch, then rounds of one epoch per configuration in
rotating order; ratios and per-step costs from the medians. Then, as the
TensorFlow `plain` section does, the train function alone, called in blocks
of steps on batches placed beforehand (Keras's per-step Python left out, one
wait per step), in rotating order. Prints one JSON line.

Usage (through bench_model.py):
    PYTHONPATH=. python benchmarks/bench_model.py --backend jax [--rounds N] [--quick]
"""

import argparse
import json
import os
import statistics
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_safe_dist import SafeDistributedModel  # noqa: E402

from _timing import interleave  # noqa: E402
from _timing import no_collection  # noqa: E402

# name: (input shape, hidden width or None for the convnet, samples, batch size);
# the same models as bench_model.py's MODELS.
MODELS = {
    "MLP 64-256-256-10": ((64,), 256, 6400, 64),
    "convnet 28x28x1": ((28, 28, 1), None, 1280, 64),
}


def _model(name, model_class, **options):
    shape, width, _, _ = MODELS[name]
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    if width is None:
        hidden = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
        hidden = keras.layers.Conv2D(16, 3, activation="relu")(hidden)
        hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    else:
        hidden = keras.layers.Dense(width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
    model = model_class(inputs, keras.layers.Dense(10)(hidden), **options)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    return model


def _wait(model):
    """Waits for the epoch's last steps, which `fit()` leaves running.

    They are counted in the epoch they belong to, not in the next
    configuration's.
    """
    jax.block_until_ready([variable.value for variable in model.variables])


def _data(name, quick):
    shape, _, samples, batch = MODELS[name]
    samples = samples // 4 if quick else samples
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, *shape)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    return x, y, batch


def step_times(configs, x, y, batch, rounds, steps):
    """Microseconds per call of each model's train function, in blocks of `steps`.

    Uses Keras's JAX trainer's own batch placement (`JAXEpochIterator`) and
    state gathering (`_get_jax_state`), private to Keras: a benchmark only.
    The state is donated to each step, so the models are not used after.
    Each step is waited for (stock and safe alike): the figure is a step's
    latency, dispatch included.

    Returns:
        name: median microseconds per step over `rounds` interleaved blocks.
    """
    from keras.src.backend.jax.trainer import JAXEpochIterator

    epoch = JAXEpochIterator(x=x, y=y, batch_size=batch, steps_per_execution=1, shuffle=False)
    data = [next(iterator) for _, _, iterator in epoch]
    states = {
        name: model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        for name, model in configs.items()
    }

    def block(name, count):
        function, state = configs[name].train_function, states[name]
        for index in range(count):
            logs, state = function(state, iter((data[index % len(data)],)))
            # One wait per step: with many steps queued, XLA's CPU all-reduce
            # rendezvous timed out (40 s, the process aborts) on the shared
            # 2-core machine.
            logs["loss"].block_until_ready()
        states[name] = state

    for name in configs:
        block(name, 5)  # warm-up
    names = list(configs)
    times = {name: [] for name in names}
    with no_collection():
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                block(name, steps)
                times[name].append(1e6 * (time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def bench(rounds, quick):
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    results = {}
    for name in MODELS:
        x, y, batch = _data(name, quick)
        configs = {
            "stock": _model(name, keras.Model),
            "safe": _model(name, SafeDistributedModel),
            # What the skip decision costs: the update under a lax.cond.
            "safe, no skip": _model(name, SafeDistributedModel, skip_nonfinite=False),
        }
        timed = interleave(configs, "stock", x, y, batch, rounds, wait=_wait)
        steps = step_times(configs, x, y, batch, rounds, max(20, -(-len(x) // batch)))
        for config, row in timed.items():
            row["step_us"] = steps[config]
            row["step_cost_us"] = steps[config] - steps["stock"]
        results[f"{name}, batch {batch}, 2 devices"] = timed
    return {
        "results": results,
        "devices": len(jax.devices()),
        "versions": {"jax": jax.__version__, "keras": keras.__version__},
        "load_average": os.getloadavg(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(bench(args.rounds, args.quick)))
