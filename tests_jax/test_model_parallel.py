"""`ModelParallel`: our per-variable state laid out like its variables, exact against stock.

Under `keras.distribution.ModelParallel` a LayoutMap shards the weights, and
Keras lays the optimizer's slots out like them. The accumulators and the
NaN detector's copies must be too: replicated, each device would hold a
whole model's worth of them. The reference is stock Keras under the same
distribution (stock clips with its optimizer's `global_clipnorm` there: one
program, no replicas).
"""

import os
import subprocess
import sys
import warnings

import jax
import keras
import numpy as np
import pytest

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import audit
from keras_safe_dist.callbacks import NaNOnsetDetector

CLIP = 0.5


def _distribution(shape, kernel=(None, "model"), bias=("model",)):
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), jax.devices()[: np.prod(shape)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = kernel
    layout_map["dense.*bias"] = bias
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _mlp(model_class, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(64, activation="relu", name="dense_a")(inputs)
    model = model_class(inputs, keras.layers.Dense(8, name="dense_b")(hidden), **options)
    clip = {} if model_class is SafeDistributedModel else {"global_clipnorm": CLIP}
    model.compile(optimizer=keras.optimizers.Adam(1e-2, **clip), loss="mse")
    return model


def _data(samples=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 16)).astype("float32")
    return x, (x[:, :8] * 2.0 + 0.1).astype("float32")


def _relative(a, b):
    a = np.concatenate([w.ravel() for w in a.get_weights()])
    b = np.concatenate([w.ravel() for w in b.get_weights()])
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _bytes_per_device(variables):
    """The most bytes of `variables`' shards any one device holds."""
    held = {}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def _spec(variable):
    return tuple(variable.value.sharding.spec)


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)], ids=["mesh_1x2", "mesh_2x1"])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_exact_against_stock_under_the_same_model_parallel(shape, accumulation):
    keras.distribution.set_distribution(_distribution(shape))
    x, y = _data()
    stock = _mlp(keras.Model)
    safe = _mlp(SafeDistributedModel, gradient_accumulation_steps=accumulation, global_clipnorm=CLIP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no JAX002: nothing is misplaced
        stock.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
        safe.fit(x, y, batch_size=16 // accumulation, epochs=3, verbose=0, shuffle=False)
    assert _relative(stock, safe) < 1e-5
    trainable = safe.trainable_variables
    engine = safe._update_engine
    assert [_spec(s) for s in engine.sums] == ([_spec(v) for v in trainable] if accumulation > 1 else [])
    # Adam's moments stay laid out like their weights, as Keras made them
    # (a check by their own path would have replicated them).
    moments = [v for v in safe.optimizer.variables if "momentum" in v.name]
    assert [_spec(m) for m in moments] == [_spec(v) for v in trainable]
    if shape == (1, 2):
        assert _spec(trainable[0]) == (None, "model")


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_non_finite_update_is_skipped_with_sharded_weights(accumulation):
    # Under ModelParallel the skip runs the update in one branch of a lax.cond.
    keras.distribution.set_distribution(_distribution((1, 2)))
    x, y = _data()
    x[20, 0] = np.inf  # in the third batch of 8
    clean = np.delete(np.arange(64), np.arange(16, 24 if accumulation == 1 else 32))
    safe = _mlp(SafeDistributedModel, gradient_accumulation_steps=accumulation, log_update_stats=True)
    with pytest.warns(UserWarning, match="skipped a non-finite update at epoch 0"):
        history = safe.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert safe._update_engine.sharded_weights  # the branch, not the select
    assert history.history["skipped_updates"] == [1.0]
    # The same updates without the skipped one, from stock Keras.
    stock = _mlp(keras.Model)
    stock.optimizer.global_clipnorm = None
    stock.fit(x[clean], y[clean], batch_size=8 * accumulation, epochs=1, verbose=0, shuffle=False)
    assert _relative(stock, safe) < 1e-5


def test_our_state_costs_at_most_one_sharded_copy_of_the_weights_per_device():
    keras.distribution.set_distribution(_distribution((1, 2)))
    x, y = _data()
    sharded = {}
    for accumulation in (1, 4):
        model = _mlp(SafeDistributedModel, gradient_accumulation_steps=accumulation)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        weights = _bytes_per_device(model.trainable_variables)
        ours = _bytes_per_device(model._update_engine.state_variables)
        sharded[accumulation] = (weights, ours)
    weights, ours = sharded[4]
    # Half the MLP's 5,192 float32 weights per device, and the same again.
    assert weights == 4 * (16 * 32 + 32 + 64 * 4 + 4)
    assert weights <= ours <= 1.1 * weights
    assert sharded[1][1] <= 128  # a few scalars


def test_bfloat16_weights_accumulate_in_float32_or_in_bfloat16_when_asked():
    # float32 sums of bfloat16 weights cost twice those weights' bytes;
    # `accumulation_dtype="bfloat16"` keeps one sharded copy, at bfloat16's
    # rounding of each micro-batch's gradient.
    keras.config.set_dtype_policy("bfloat16")
    keras.distribution.set_distribution(_distribution((1, 2)))
    x, y = _data()
    # SGD: Adam's first updates are +-lr whatever the gradient's rounding.
    stock = _mlp(keras.Model)
    stock.compile(optimizer=keras.optimizers.SGD(0.05, global_clipnorm=CLIP), loss="mse")
    stock.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    for chosen, dtype, share in ((None, "float32", 2.0), ("bfloat16", "bfloat16", 1.0)):
        safe = _mlp(
            SafeDistributedModel, gradient_accumulation_steps=4, global_clipnorm=CLIP,
            accumulation_dtype=chosen,
        )
        safe.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        safe.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False)
        sums = safe._update_engine.sums
        weights = _bytes_per_device(safe.trainable_variables)
        assert {s.dtype for s in sums} == {dtype}, chosen
        assert _bytes_per_device(sums) == share * weights, chosen
        assert [_spec(s) for s in sums] == [_spec(v) for v in safe.trainable_variables]
        # Measured: 5.8e-4 with float32 sums, 7.1e-4 with bfloat16 ones.
        assert _relative(stock, safe) < 5e-3, chosen


def test_a_nan_onset_is_found_and_restored_with_sharded_weights(tmp_path):
    keras.distribution.set_distribution(_distribution((1, 2)))
    x, y = _data()
    x[37, 3] = np.nan
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2)
    detector = NaNOnsetDetector(str(tmp_path), action="restore", check_every=2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[detector])
    report = detector.report
    assert (report["batch"], report["kind"], report["rows"]) == (4, "inputs", [5])
    copies = model._nan_link.watch.snapshot
    sources = list(model.trainable_variables) + list(model.optimizer.variables)
    assert [_spec(c) for c in copies] == [_spec(v) for v in sources]
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_the_callbacks_raise_no_false_alarm_under_model_parallel(tmp_path, capsys):
    from keras_safe_dist import callbacks
    from keras_safe_dist import cli

    keras.distribution.set_distribution(_distribution((1, 2)))
    x, y = _data()
    log_dir = str(tmp_path)
    model = _mlp(SafeDistributedModel, gradient_accumulation_steps=2, log_update_stats=True)
    detector = callbacks.NaNOnsetDetector(log_dir=log_dir, action="restore")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no audit warns, no JAX002
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[
            callbacks.ScopeAudit(log_dir=log_dir),
            callbacks.AggregationAudit(log_dir=log_dir),
            callbacks.TrainingModeAudit(log_dir=log_dir),
            callbacks.Dashboard(log_dir),
            detector,
        ])
    assert detector.report is None
    assert cli.main(["report", log_dir]) == 0  # no warning or error finding
    out = capsys.readouterr().out
    assert "Findings (0 error, 0 warning, 1 info)" in out  # the info: JAX001, what ran
    assert "| JAX002 |" not in out and "| NAN001 |" not in out


def test_audit_names_a_weight_the_layout_map_lays_out_otherwise():
    keras.distribution.set_distribution(_distribution((1, 2)))
    model = _mlp(SafeDistributedModel)
    assert [f.code for f in audit(model) if f.code != "JAX001"] == []  # JAX001: what ran
    # The same mesh, a LayoutMap that replicates the kernels.
    keras.distribution.set_distribution(_distribution((1, 2), kernel=(None, None)))
    findings = [f for f in audit(model) if f.code == "JAX002"]
    assert len(findings) == 1
    assert "dense_a/kernel is on cpu:0, cpu:1 as P(None, 'model'), not P(None, None)" in findings[0].message


_GEMMA = dict(
    vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=2,
    hidden_dim=16, intermediate_dim=32, head_dim=8,
)


def _gemma(model_class, **options):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**_GEMMA)
    inputs = {
        "token_ids": keras.Input((8,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((8,), dtype="int32", name="padding_mask"),
    }
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    model = model_class(inputs, logits, **options)
    clip = {} if model_class is SafeDistributedModel else {"global_clipnorm": CLIP}
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2, **clip),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_keras_hub_gemma_with_its_own_layout_map_is_exact_with_accumulation():
    keras_hub = pytest.importorskip("keras_hub")
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), jax.devices())
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 64, size=(32, 8)).astype("int32"),
        "padding_mask": np.ones((32, 8), "int32"),
    }
    y = rng.integers(0, 64, size=(32, 8)).astype("int32")
    stock = _gemma(keras.Model)
    safe = _gemma(SafeDistributedModel, gradient_accumulation_steps=4, global_clipnorm=CLIP)
    safe.set_weights(stock.get_weights())
    stock.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    safe.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False)
    assert _relative(stock, safe) < 1e-5
    sums, trainable = safe._update_engine.sums, safe.trainable_variables
    assert [_spec(s) for s in sums] == [_spec(v) for v in trainable]
    assert any("model" in _spec(v) for v in trainable)  # the map shards some weights
    weights = _bytes_per_device(trainable)
    assert _bytes_per_device(safe._update_engine.state_variables) <= 1.1 * weights


_FOUR_DEVICES = """
import os
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import sys
sys.path.insert(0, {tests!r})
import keras, numpy as np
import test_model_parallel as t
keras.distribution.set_distribution(t._distribution((2, 2)))
x, y = t._data()
stock = t._mlp(keras.Model)
safe = t._mlp(t.SafeDistributedModel, gradient_accumulation_steps=4, global_clipnorm=t.CLIP)
stock.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
safe.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False)
specs = [t._spec(s) == t._spec(v) for s, v in zip(safe._update_engine.sums, safe.trainable_variables)]
print("RESULT", t._relative(stock, safe), all(specs), len(specs))
"""


def test_a_2x2_mesh_on_four_devices_is_exact():
    script = _FOUR_DEVICES.format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    relative, laid_out, count = done.stdout.split("RESULT")[1].split()
    assert float(relative) < 1e-5
    assert (laid_out, count) == ("True", "4")
