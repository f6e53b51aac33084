"""A skipped non-finite update on JAX leaves the weights and the optimizer state as they were."""

import keras
import numpy as np

from keras_safe_dist import SafeDistributedModel

from conftest import regression_data


def test_skipped_update_keeps_weights_and_adam_state_bit_for_bit(devices):
    x, y, _ = regression_data(16)
    inputs = keras.Input((4,))
    model = SafeDistributedModel(
        inputs, keras.layers.Dense(3)(inputs), log_update_stats=True, global_clipnorm=1.0
    )
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    model.train_on_batch(x[:8], y[:8])
    before = [np.array(v.value) for v in model.weights + model.optimizer.variables]
    bad = x[8:].copy()
    bad[3, 1] = np.nan
    logs = model.train_on_batch(bad, y[8:], return_dict=True)
    after = [np.array(v.value) for v in model.weights + model.optimizer.variables]
    assert logs["skipped_updates"] == 1.0
    assert int(model.optimizer.iterations.value) == 1
    for old, new in zip(before, after):
        np.testing.assert_array_equal(old, new)
    logs = model.train_on_batch(x[8:], y[8:], return_dict=True)
    assert int(model.optimizer.iterations.value) == 2  # the next finite update applies
    assert not np.array_equal(before[0], np.array(model.weights[0].value))
