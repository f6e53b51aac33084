"""Every dtype policy Keras accepts trains, against stock Keras on one device."""

import keras
import numpy as np
import pytest

from keras_safe_dist import SafeDistributedModel

from conftest import regression_data
from conftest import relative_error
from conftest import strategy_for

# Relative error of the final weights against stock Keras on one device with
# one batch per update (measured: docs/model.md, "Where exactness ends").
TOLERANCE = {
    "float64": 1e-10,
    "float32": 1e-5,
    "float16": 5e-3,
    "bfloat16": 5e-2,
    "mixed_float16": 5e-3,
    "mixed_bfloat16": 5e-2,
}


@pytest.fixture
def policy(request):
    keras.config.set_dtype_policy(request.param)
    if request.param == "float64":
        keras.config.set_floatx("float64")
    yield request.param
    keras.config.set_floatx("float32")


def build():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    # Under a mixed policy the output layer computes in float32, as Keras's
    # mixed precision guide advises.
    mixed = keras.config.dtype_policy().name.startswith("mixed")
    return inputs, keras.layers.Dense(1, dtype="float32" if mixed else None)(hidden)


def fit_both(replicas, steps, x, y, **options):
    keras.utils.set_random_seed(3)
    reference = keras.Model(*build())
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with strategy_for(replicas).scope():
        model = SafeDistributedModel(
            *build(), gradient_accumulation_steps=steps, log_update_stats=True, **options
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.set_weights(reference.get_weights())
    fit = dict(epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16 * steps, **fit)
    history = model.fit(x, y, batch_size=16, **fit)
    return reference, model, history


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize(
    "policy",
    ["float64", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"],
    indirect=True,
)
def test_every_policy_trains_as_stock_on_one_device(replicas, steps, policy):
    x, y, _ = regression_data(50)
    reference, model, history = fit_both(replicas, steps, x, y)
    weights = [np.asarray(w, "float64") for w in model.get_weights()]
    assert all(np.isfinite(w).all() for w in weights)
    error = relative_error(
        [np.asarray(w, "float64") for w in reference.get_weights()], weights
    )
    assert error < TOLERANCE[policy], error
    assert history.history["skipped_updates"][-1] == 0
    assert history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.parametrize("policy", ["float64"], indirect=True)
def test_float64_norm_beyond_float32_range_is_finite(replicas, policy):
    # A gradient norm of about 1e40 overflows float32 but not float64: the
    # update is applied and logged, not skipped as non-finite.
    x, y, _ = regression_data(32)
    _, model, history = fit_both(replicas, 2, x, y * 1e38, global_clipnorm=1.0)
    assert history.history["skipped_updates"][-1] == 0
    assert history.history["grad_norm"][-1] > 1e38
    assert history.history["clip_rate"][-1] == 1.0


@pytest.mark.parametrize("steps", [2, 4])
@pytest.mark.parametrize("policy", ["bfloat16", "float32"], indirect=True)
def test_accumulation_dtype_keeps_the_sums_in_it(replicas, steps, policy):
    # bfloat16 sums: half the accumulators' bytes of float32 ones, each
    # micro-batch's gradient rounded into bfloat16. Against stock Keras on one
    # device at one batch per update, within the bfloat16 bound.
    x, y, _ = regression_data(64)
    reference, model, history = fit_both(replicas, steps, x, y, accumulation_dtype="bfloat16")
    sums = model._update_engine.sums.dense
    assert [s.variable.dtype.name for s in sums] == ["bfloat16"] * len(model.trainable_weights)
    assert [w.dtype for w in model.trainable_weights] == [policy] * len(sums)
    error = relative_error(
        [np.asarray(w, "float64") for w in reference.get_weights()],
        [np.asarray(w, "float64") for w in model.get_weights()],
    )
    assert error < TOLERANCE["bfloat16"], error
    assert history.history["skipped_updates"][-1] == 0
