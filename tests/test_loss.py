"""Splitting compiled losses into exact numerators and denominators."""

import keras
import numpy as np
import pytest

from keras_safe_dist import SafeDistributedModel

from conftest import regression_data
from conftest import relative_error
from conftest import strategy_for


def two_outputs():
    inputs = keras.Input((4,))
    return SafeDistributedModel(
        inputs, {"a": keras.layers.Dense(1, name="a")(inputs), "b": keras.layers.Dense(1, name="b")(inputs)}
    )


def test_masked_sequence_loss_matches_one_big_batch(replicas):
    rng = np.random.default_rng(6)
    x = rng.integers(1, 9, size=(30, 5))
    x[:, 3:] = 0
    x[::4, 1:] = 0
    y = rng.normal(size=(30, 5, 1)).astype("float32")

    def build(cls):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((5,), dtype="int32")
        embedded = keras.layers.Embedding(9, 3, mask_zero=True)(inputs)
        return cls(inputs, keras.layers.Dense(1)(embedded))

    stock = build(keras.Model)
    stock.compile(optimizer=keras.optimizers.SGD(0.3), loss="mse")
    with strategy_for(replicas).scope():
        model = build(SafeDistributedModel)
        model.gradient_accumulation_steps = 2
        model.compile(optimizer=keras.optimizers.SGD(0.3), loss="mse")
    stock.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert relative_error(stock.get_weights(), model.get_weights()) < 1e-5


def test_unreduced_loss_is_refused():
    x, y, _ = regression_data(8)
    inputs = keras.Input((4,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction=None))
    with pytest.raises(ValueError, match="Received: loss 'mean_squared_error' with reduction=None"):
        model.fit(x, y, verbose=0)


def test_mixed_multi_output_reductions_are_refused():
    x, y, _ = regression_data(8)
    model = two_outputs()
    model.compile(
        optimizer="sgd",
        loss={"a": "mse", "b": keras.losses.MeanSquaredError(reduction="sum")},
    )
    with pytest.raises(ValueError) as error:
        model.fit(x, {"a": y, "b": y}, verbose=0)
    assert "cannot accumulate this multi-output loss exactly" in str(error.value)
    assert "reduction='sum'" in str(error.value)


def test_loss_overriding_call_dunder_is_refused():
    class Odd(keras.losses.Loss):
        def __call__(self, y_true, y_pred, sample_weight=None):
            return keras.ops.mean(y_pred)

    x, y, _ = regression_data(8)
    inputs = keras.Input((4,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss=Odd())
    with pytest.raises(TypeError, match="does not override `__call__`"):
        model.fit(x, y, verbose=0)


def test_add_loss_only_model_trains():
    class Penalised(SafeDistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            outputs = self.dense(inputs)
            self.add_loss(keras.ops.mean(outputs**2))
            return outputs

    x, _, _ = regression_data(16)
    model = Penalised()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    history = model.fit(x, epochs=3, batch_size=8, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]


def per_token_model(cls):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(
        9, 3, mask_zero=True, embeddings_initializer=keras.initializers.RandomNormal(stddev=2.0)
    )(inputs)
    return cls(inputs, keras.layers.Dense(1)(embedded))


@pytest.mark.parametrize(
    "loss,weighted",
    [("mse", False), (keras.losses.MeanSquaredError(reduction="sum"), False),
     (keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"), True)],
    ids=["masked", "sum", "mean_with_sample_weight"],
)
def test_logged_loss_is_stock_one_device_loss_weighted_by_samples(replicas, loss, weighted):
    # Frozen weights: every logged value is a pure function of the batch.
    # The first batch holds short sequences, so a batch's unmasked tokens are
    # not proportional to its samples; the last batch is short (33 = 16+16+1),
    # which leaves one replica an empty share.
    rng = np.random.default_rng(6)
    x = rng.integers(1, 9, size=(33, 5))
    x[:16, 2:] = 0
    y = rng.normal(size=(33, 5, 1)).astype("float32")
    sample_weight = rng.uniform(0.1, 3.0, size=(33, 5)) if weighted else None
    stock = per_token_model(keras.Model)
    stock.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
    with strategy_for(replicas).scope():
        model = per_token_model(SafeDistributedModel)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
    fit = dict(sample_weight=sample_weight, batch_size=16, epochs=1, shuffle=False, verbose=0)
    expected = stock.fit(x, y, **fit).history["loss"][0]
    logged = model.fit(x, y, **fit).history["loss"][0]
    assert logged == pytest.approx(expected, rel=1e-6)
    # Token weighting (the number of unmasked tokens per batch) differs.
    batches = [x[:16], x[16:32], x[32:]]
    tokens = np.array([np.count_nonzero(b) for b in batches], "float64")
    samples = np.array([len(b) for b in batches], "float64")
    assert not np.allclose(tokens / tokens.sum(), samples / samples.sum(), rtol=0.05)


def test_sample_weights_keras_would_spread_across_the_batch_are_refused(replicas):
    x, y, _ = regression_data(8)
    weights = np.arange(1, 9, dtype="float32").reshape(8, 1, 1)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    stock = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    stock.compile(optimizer="sgd", loss="mse")
    # Stock Keras: each sample's loss times every sample's weight, the mean
    # loss times the mean weight, whatever the weights say.
    spread = stock.evaluate(x, y, sample_weight=weights, batch_size=8, verbose=0)
    assert spread == pytest.approx(stock.evaluate(x, y, batch_size=8, verbose=0) * 4.5, rel=1e-5)
    with strategy_for(replicas).scope():
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"sample_weight of shape \(\d+, 1, 1\) for loss values of shape \(\d+,\)"):
        model.fit(x, y, sample_weight=weights, batch_size=8, verbose=0)
    # One trailing axis of size 1 is Keras's to drop: trained as stock trains it.
    model.fit(x, y, sample_weight=weights.reshape(8, 1), batch_size=8, verbose=0)
