"""`nonfinite-skip`, measured once for every backend: the state one NaN step changes.

Both sides take one Adam step on a clean batch of 4 samples per device (which
builds Adam's moments), then one on that batch with a NaN in it; the figure
is how many weights and optimizer variables the NaN step changed (0 is
correct).
"""

import keras
import numpy as np

from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.shared_probes import tiny
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["CHECKS", "NAME", "run"]

NAME = "nonfinite-skip"
CHECKS = (
    "one Adam step on a batch holding a NaN: weights and optimizer variables "
    "changed (0 is correct)"
)


def run(backend, place):
    """Returns `(stock, safe)`: how many state variables each side's NaN step changed.

    Args:
        backend: the backend's `_tiny` module (a `tiny.Tiny`).
        place: where both sides train (the probes' replicas or devices).
    """
    batch = 4 * backend.devices(place)
    x, y = tiny.data(batch)
    poisoned = x.copy()
    poisoned[0, 0] = np.nan

    def side(cls):
        model = backend.mlp(cls, place, optimizer=lambda: keras.optimizers.Adam(0.01))
        backend.update(model, place, x, y, batch)  # builds Adam's moments
        variables = model.weights + model.optimizer.variables
        before = [np.array(v.numpy()) for v in variables]
        backend.update(model, place, poisoned, y, batch)
        changed = sum(
            not np.array_equal(old, v.numpy(), equal_nan=True)
            for old, v in zip(before, variables)
        )
        return Side(changed == 0, changed)

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))
