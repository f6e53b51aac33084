"""No false positives: standard layers, optimizers and metrics audit clean."""

import keras
import numpy as np
import pytest

import keras_safe_dist
from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks

from conftest import strategy_for

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
}


def standard_model(cls):
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(20, 8)(tokens)
    x = keras.layers.Conv1D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.2)(x)
    x = keras.layers.LSTM(8)(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(x)
    return cls(tokens, outputs)


@pytest.mark.parametrize("cls", [keras.Model, SafeDistributedModel], ids=["stock", "safe"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_standard_setup_has_no_warnings_or_errors(replicas, optimizer, cls):
    if optimizer == "loss_scale":
        keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(16, 6)).astype("int32")
    y = rng.integers(0, 2, size=(16, 1)).astype("float32")
    with strategy_for(replicas).scope():
        model = standard_model(cls)
        model.compile(
            optimizer=OPTIMIZERS[optimizer](),
            loss="binary_crossentropy",
            metrics=["accuracy", keras.metrics.AUC()],
        )
    audits = [
        callbacks.ScopeAudit(on_finding="raise"),
        callbacks.AggregationAudit(on_finding="raise"),
        callbacks.TrainingModeAudit(on_finding="raise"),
    ]
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=audits)
    reports = [keras_safe_dist.audit(model)] + [a.report for a in audits]
    serious = [f for report in reports for f in report.at_least("warning")]
    assert serious == []
    # Only the documented infos: per-replica BatchNormalization statistics,
    # and a stock model's loss on batches that split unevenly.
    infos = {f.code for report in reports for f in report}
    expected = {"MODE004", "DIST004"} if cls is keras.Model else {"MODE004"}
    assert infos == (set() if replicas == 1 else expected)
    # The audits saw the whole setup.
    paths = {v.path for v in audits[1].variables}
    assert any(p.endswith("moving_mean") for p in paths)
    assert any(p.startswith("auc") for p in paths)
