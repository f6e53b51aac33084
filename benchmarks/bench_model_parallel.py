"""Memory per device and step time under `keras.distribution.ModelParallel`, on 2 JAX CPU devices.

For two models whose weights a LayoutMap shards over a (1, 2) mesh, stock
`keras.Model` and `SafeDistributedModel` at `gradient_accumulation_steps`
1 and 4, all with Adam (and at 4 with bfloat16 weights, their sums in
float32 by default and in bfloat16 with `accumulation_dtype="bfloat16"`):

- bytes per device, from the arrays' shards on each device (the most any
  device holds): the trainable weights, the optimizer's state, and our own
  state (the update engine's accumulators, totals and statistics);
- the step time of safe (accumulation 1) against stock, 21 rounds of one
  epoch each in rotating order after a warm-up epoch: the median of each
  round's ratio with its 95% bootstrap interval, and the difference of the
  median epochs per step. Two controls in the same rotation: stock with a
  `global_clipnorm` too large to clip (it reads the global norm, as the
  skip does) and safe with `skip_nonfinite=False` (nothing reads it).

Models: an MLP 256-1024-1024-256 with every Dense kernel and bias sharded
over "model", and keras-hub's Gemma backbone built from config (no
preset: 4 layers, hidden 128, 4 heads, vocabulary 1000) with its own
`GemmaBackbone.get_layout_map`; skipped when keras-hub is not installed.

Usage:
    python benchmarks/bench_model_parallel.py [--rounds 21] [--json]
"""

import argparse
import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keras_safe_dist import SafeDistributedModel  # noqa: E402

from _timing import interleave  # noqa: E402

MESH = (1, 2)
BATCH = 32


def _mesh():
    return keras.distribution.DeviceMesh(MESH, ("batch", "model"), jax.devices()[:2])


def _mlp_setup():
    layout_map = keras.distribution.LayoutMap(_mesh())
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["dense.*bias"] = ("model",)

    def build(model_class, clip=None, **options):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((256,))
        hidden = inputs
        for width in (1024, 1024):
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = model_class(inputs, keras.layers.Dense(256)(hidden), **options)
        model.compile(optimizer=keras.optimizers.Adam(1e-3, global_clipnorm=clip), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 16, 256)).astype("float32")
    return layout_map, build, x, x


def _gemma_setup():
    try:
        import keras_hub
    except ImportError:
        return None
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(_mesh())
    config = dict(
        vocabulary_size=1000, num_layers=4, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=128, intermediate_dim=512, head_dim=32,
    )

    def build(model_class, clip=None, **options):
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(**config)
        inputs = {
            "token_ids": keras.Input((32,), dtype="int32", name="token_ids"),
            "padding_mask": keras.Input((32,), dtype="int32", name="padding_mask"),
        }
        logits = backbone.token_embedding(backbone(inputs), reverse=True)
        model = model_class(inputs, logits, **options)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3, global_clipnorm=clip),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    rng = np.random.default_rng(0)
    samples = BATCH * 8
    x = {
        "token_ids": rng.integers(0, 1000, size=(samples, 32)).astype("int32"),
        "padding_mask": np.ones((samples, 32), "int32"),
    }
    return layout_map, build, x, rng.integers(0, 1000, size=(samples, 32)).astype("int32")


def bytes_per_device(variables):
    """The most bytes of `variables`' shards that any one device holds."""
    held = {}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values()) if held else 0


def _total_bytes(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def _wait(model):
    jax.block_until_ready([v.value for v in model.variables])


def measure(name, setup, rounds):
    layout_map, build, x, y = setup
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    memory = {}
    models = {}
    four = {"gradient_accumulation_steps": 4}
    for label, model_class, options, policy in (
        ("stock", keras.Model, {}, "float32"),
        ("safe, accumulation 1", SafeDistributedModel, {}, "float32"),
        ("safe, accumulation 4", SafeDistributedModel, four, "float32"),
        ("safe, accumulation 4, bfloat16 weights", SafeDistributedModel, four, "bfloat16"),
        (
            "safe, accumulation 4, bfloat16 weights, accumulation_dtype='bfloat16'",
            SafeDistributedModel,
            {**four, "accumulation_dtype": "bfloat16"},
            "bfloat16",
        ),
    ):
        keras.config.set_dtype_policy(policy)
        try:
            model = build(model_class, **options)
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
            _wait(model)
        finally:
            keras.config.set_dtype_policy("float32")
        engine = getattr(model, "_update_engine", None)
        memory[label] = {
            "weights": bytes_per_device(model.trainable_variables),
            "optimizer": bytes_per_device(model.optimizer.variables),
            "ours": bytes_per_device(engine.state_variables) if engine is not None else 0,
        }
        models[label] = model
    trainable = models["stock"].trainable_variables
    # Two controls: the skip's cost is the global norm it reads, which stock
    # pays too when it clips (a clip norm so large it never clips); without
    # the skip, nothing reads the norm.
    controls = {
        "stock, global_clipnorm": build(keras.Model, clip=1e30),
        "safe, skip_nonfinite=False": build(SafeDistributedModel, skip_nonfinite=False),
    }
    timed = interleave(
        {"stock": models["stock"], "safe": models["safe, accumulation 1"], **controls},
        "stock", x, y, BATCH, rounds, wait=_wait,
    )
    keras.distribution.set_distribution(None)
    steps = -(-len(y) // BATCH)  # `x` may be a dict of arrays
    stock_s, safe_s = timed["stock"]["median_epoch_s"], timed["safe"]["median_epoch_s"]
    return {
        "model": name,
        "weights_total": _total_bytes(trainable),
        "memory_per_device": memory,
        "steps": steps,
        "step_ms": 1e3 * stock_s / steps,
        "ratio": timed["safe"]["median_ratio"],
        "ratio_interval": list(timed["safe"]["ratio_interval"]),
        "per_step_us": 1e6 * (safe_s - stock_s) / steps,
        "controls": {
            name: {
                "ratio": timed[name]["median_ratio"],
                "ratio_interval": list(timed[name]["ratio_interval"]),
                "per_step_us": timed[name]["per_step_us"],
            }
            for name in controls
        },
    }


def table(results, rounds):
    lines = [
        f"jax {jax.__version__}, keras {keras.__version__}, ModelParallel mesh {MESH} on 2 CPU "
        f"devices, batch {BATCH}, {rounds} rounds",
        "",
        "| model | configuration | weights / device | optimizer / device | ours / device | "
        "ours / weights |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        for label, row in result["memory_per_device"].items():
            share = row["ours"] / row["weights"]
            lines.append(
                f"| {result['model']} ({result['weights_total'] / 1e6:.2f} MB of weights in float32) | "
                f"{label} | {row['weights'] / 1e6:.2f} MB | {row['optimizer'] / 1e6:.2f} MB | "
                f"{row['ours'] / 1e3:.1f} kB | {share:.3f} |"
            )
    lines += ["", "| model | stock step | configuration | / stock (95% interval) | per step |",
              "| --- | ---: | --- | ---: | ---: |"]
    for result in results:
        rows = {"safe": result, **result["controls"]}
        for label, row in rows.items():
            low, high = row["ratio_interval"]
            lines.append(
                f"| {result['model']} | {result['step_ms']:.2f} ms | {label} | {row['ratio']:.3f} "
                f"({low:.3f}-{high:.3f}) | {row['per_step_us']:+.0f} µs |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (default 21)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be an integer >= 1. Received: {args.rounds}")
    results = [measure("MLP 256-1024-1024-256", _mlp_setup(), args.rounds)]
    gemma = _gemma_setup()
    if gemma is not None:
        results.append(measure("Gemma from config, 4 layers", gemma, args.rounds))
    print(json.dumps(results) if args.json else table(results, args.rounds))


if __name__ == "__main__":
    main()
