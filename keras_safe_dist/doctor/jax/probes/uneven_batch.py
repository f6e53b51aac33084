"""Probe (JAX): fit, evaluate and predict on a batch the devices do not divide.

Keras's JAX trainer shards every batch along the data-parallel axis and
raises `IndivisibleError` when the device count does not divide it (the
last batch of an epoch, typically), in `fit`, `evaluate` and `predict`
alike. SafeDistributedModel places such a batch whole on every device
(`backend/jax/_compat.uneven_batches_replicated`), so it computes the one-device result.
The figure is the largest relative deviation of the three from one device
(the update, the loss, the predictions: 0 is correct), or which of them
crashed and the error.
"""

import keras

from keras_safe_dist.doctor.jax.probes import _tiny
from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probe import one_line
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]


def run(distribution):
    # 2 x devices + 1 samples: one batch that leaves a remainder of 1.
    x, y = _tiny.data(2 * _tiny.devices(distribution) + 1)
    batch = len(x)
    reference = _tiny.mlp(keras.Model, _tiny.one_device())
    start = reference.get_weights()
    expected = {
        "evaluate": reference.evaluate(x, y, batch_size=batch, verbose=0),
        "predict": reference.predict(x, batch_size=batch, verbose=0),
        "fit": _tiny.update(reference, _tiny.one_device(), x, y, batch),
    }

    def side(cls):
        model = _tiny.mlp(cls, distribution, weights=start)
        with _tiny.on(distribution):
            calls = {
                "evaluate": lambda: model.evaluate(x, y, batch_size=batch, verbose=0),
                "predict": lambda: model.predict(x, batch_size=batch, verbose=0),
                "fit": lambda: _tiny.update(model, distribution, x, y, batch),
            }
            measured = {name: _outcome(call) for name, call in calls.items()}
        crashed = [name for name, (_, error) in measured.items() if error is not None]
        if crashed:
            return Side(False, f"{', '.join(crashed)} crashed: {measured[crashed[0]][1]}")
        value = max(
            _tiny.relative_deviation(expected[name], measured[name][0]) for name in calls
        )
        return Side(value <= TOLERANCE, value)

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))


def _outcome(call):
    """`(value, None)`, or `(None, the error in one line)` when `call()` raises."""
    try:
        return call(), None
    except Exception as error:  # noqa: BLE001 - a crash is the measurement
        return None, one_line(error)


PROBE = Probe(
    name="uneven-batch",
    checks=(
        "fit, evaluate and predict on one batch of 2 x devices + 1 samples: largest "
        "relative deviation of the update, loss and predictions from one device (0 is "
        "correct), or what crashed"
    ),
    run=run,
)
