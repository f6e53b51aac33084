"""The promise's own numbers: SafeDistributedModel against stock, and stock against itself.

For each case the promise covers loosely, relative errors of the weights after
training, against a float64 reference: stock `keras.Model` on one device, one
batch of all the samples, under the `float64` policy, from the same initial
weights.

- `stock`: stock Keras on one device at the case's precision, one big batch:
  its own rounding error, the floor no re-split of the batch can be held below;
- `safe`: SafeDistributedModel with the change (two replicas, accumulation);
- `safe_vs_stock`: the promise's own metric, SafeDistributedModel against stock
  on one device at the same precision.

(Stock's own `gradient_accumulation_steps` is no reference for Adam: its
`iterations` counts micro-batches, which moves Adam's bias correction.)

Each error is reported as the global one (`||w - w_ref|| / ||w_ref||` over all
weights) and the largest per variable (`max |w - w_ref| / max |w_ref|`). Run:

    PYTHONPATH=. python3 benchmarks/bench_floor.py                    # TensorFlow, 2 CPUs
    PYTHONPATH=. python3 benchmarks/bench_floor.py --backend jax      # JAX, 2 CPU devices
"""

import argparse
import json
import os
import sys


def _setup(backend):
    os.environ["KERAS_BACKEND"] = backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if backend == "jax":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        os.environ["JAX_ENABLE_X64"] = "1"  # or the float64 reference is float32
        return None
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _transformer(keras, vocab=1000, length=16, dim=64):
    inputs = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim)(inputs)
    attended = keras.layers.MultiHeadAttention(4, dim // 4)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(dim)(keras.layers.Dense(2 * dim, activation="relu")(x)))
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.GlobalAveragePooling1D()(x))
    return inputs, outputs


def _embedding(keras, vocab=1000, length=8, dim=16):
    inputs = keras.Input((length,), dtype="int32")
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocab, dim)(inputs))
    return inputs, keras.layers.Dense(1)(x)


def _conv_bn(keras):
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(8, 3, use_bias=True)(inputs)  # a bias right before BatchNormalization
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(x))
    return inputs, keras.layers.Dense(1)(x)


def _data(np, case, samples=256):
    rng = np.random.default_rng(0)
    if case.startswith("conv"):
        x = rng.normal(size=(samples, 8, 8, 1)).astype("float32")
    else:
        length = 16 if case.startswith("transformer") else 8
        x = rng.integers(0, 1000, size=(samples, length)).astype("int32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    return x, y


# name: (builder, policy, optimizer, SafeDistributedModel's options, replicas, split)
CASES = {
    "transformer_mixed_float16": (_transformer, "mixed_float16", "adam", {}, 2, 2),
    "embedding_adam_accumulation_4": (_embedding, "float32", "adam", {"gradient_accumulation_steps": 4}, 2, 4),
    "transformer_adam_zero_gradient_key_bias": (_transformer, "float32", "adam", {}, 2, 2),
    "conv_bias_before_batch_norm_adam": (_conv_bn, "float32", "adam", {}, 2, 2),
}


def _errors(np, weights, reference):
    """Relative errors; variables that stay 0 in the reference (a true gradient of 0) apart.

    Their reference is 0, so a relative error means nothing there: `zero_gradient_noise`
    is the largest |w| they hold instead, relative to the model's largest weight.
    """
    diff = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(weights, reference)))
    norm = np.sqrt(sum(float(np.sum(b**2)) for b in reference))
    scale = max(float(np.abs(b).max()) for b in reference)
    moving = [(a, b) for a, b in zip(weights, reference) if np.abs(b).max() > 1e-6 * scale]
    still = [a for a, b in zip(weights, reference) if np.abs(b).max() <= 1e-6 * scale]
    worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in moving)
    noise = max((float(np.abs(a).max()) / scale for a in still), default=None)
    return {"global": diff / norm, "max_per_variable": worst, "zero_gradient_noise": noise}


def measure(backend, strategy, case, epochs, batch):
    import keras
    import numpy as np

    from keras_safe_dist import SafeDistributedModel

    build, policy, optimizer, options, replicas, splits = CASES[case]
    x, y = _data(np, case)
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    inputs, outputs = build(keras)
    initial = [np.asarray(w, "float64") for w in keras.Model(inputs, outputs).get_weights()]

    def trained(model_class, scope, precision, micro=batch, **model_options):
        keras.config.set_dtype_policy(precision)
        with scope:
            inputs, outputs = build(keras)
            model = model_class(inputs, outputs, **model_options)
            model.set_weights([w.astype(v.dtype) for w, v in zip(initial, model.weights)])
            model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=micro, epochs=epochs, shuffle=False, verbose=0)
        keras.config.set_dtype_policy("float32")
        return [np.asarray(w, dtype="float64") for w in model.get_weights()]

    import contextlib

    one = contextlib.nullcontext()
    reference = trained(keras.Model, one, "float64")
    stock = trained(keras.Model, one, policy)
    micro = batch // options.get("gradient_accumulation_steps", 1)
    if backend == "tensorflow":
        several = strategy.scope()
    else:
        several = keras.distribution.DataParallel(devices=__import__("jax").devices()).scope()
    safe = trained(SafeDistributedModel, several, policy, micro=micro, **options)
    return {
        "stock": _errors(np, stock, reference),
        "safe": _errors(np, safe, reference),
        "safe_vs_stock": _errors(np, safe, stock),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--epochs", default="1,3")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    strategy = _setup(args.backend)
    results = {}
    for case in args.cases.split(","):
        for epochs in (int(e) for e in args.epochs.split(",")):
            result = measure(args.backend, strategy, case, epochs, args.batch)
            results[f"{case}, {epochs} epoch(s)"] = result
            print(
                f"{args.backend} {case}, {epochs} epoch(s): "
                + ", ".join(
                    f"{name} {value['global']:.2e} (max per variable {value['max_per_variable']:.2e}"
                    + (
                        f", zero-gradient weights up to {value['zero_gradient_noise']:.1e} of the largest)"
                        if value["zero_gradient_noise"] is not None else ")"
                    )
                    for name, value in result.items()
                ),
                flush=True,
            )
    json.dump(results, sys.stderr, indent=1)


if __name__ == "__main__":
    main()
