"""An overridden `compute_loss()` on JAX: what the step minimizes, logs and writes.

Keras's own tests (`trainer_test.py`'s `test_metric_update_in_compute_loss`,
`test_fwd_pass_loss_presence_in_compute_loss`, `model_test.py`'s
`test_functional_list_outputs_with_custom_compute_loss`) override it; the
JAX step must use it as stock Keras's JAX step does.
"""

import keras
import numpy as np
from keras import ops

from keras_safe_dist import SafeDistributedModel

from conftest import regression_data


def custom(base):
    class Custom(base):
        """Twice the MSE plus the mean absolute prediction; counts its calls in a metric."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = keras.metrics.Sum(name="calls")

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            self.calls.update_state(1.0)
            return 2.0 * ops.mean(ops.square(y_pred - y)) + ops.mean(ops.abs(y_pred))

    return Custom


def fit_once(cls, x, y):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    model = cls(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    start = [np.array(w) for w in model.get_weights()]
    history = model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    update = np.concatenate([(w - s).ravel() for w, s in zip(model.get_weights(), start)])
    return update, history.history, float(model.calls.result())


def test_overridden_compute_loss_drives_the_update_loss_and_its_metric_as_stock(devices):
    x, y, _ = regression_data(8)
    stock_update, stock_logs, stock_calls = fit_once(custom(keras.Model), x, y)
    safe_update, safe_logs, safe_calls = fit_once(custom(SafeDistributedModel), x, y)
    # The compiled MSE alone would move the weights half as far, differently.
    np.testing.assert_allclose(safe_update, stock_update, rtol=1e-5, atol=1e-7)
    assert set(safe_logs) == set(stock_logs) == {"loss", "calls"}
    np.testing.assert_allclose(safe_logs["loss"], stock_logs["loss"], rtol=1e-6)
    assert safe_calls == stock_calls == 1.0
