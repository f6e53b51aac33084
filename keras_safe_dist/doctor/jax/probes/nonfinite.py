"""Probe (JAX): an update whose gradient is not finite.

Stock Keras applies a NaN gradient: the weights and Adam's moments become
NaN and the step counter moves. SafeDistributedModel (`skip_nonfinite=True`,
the default) skips the update. Both sides train under `DataParallel` on a
batch the devices divide. The figure is how many of the model's weights and
optimizer variables one step with a NaN input changed: 0 is correct.
"""

import keras
import numpy as np

from keras_safe_dist.doctor.jax.probes import _tiny
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.model import SafeDistributedModel

__all__ = ["PROBE"]


def run(distribution):
    batch = 4 * _tiny.devices(distribution)
    x, y = _tiny.data(batch)
    poisoned = x.copy()
    poisoned[0, 0] = np.nan

    def side(cls):
        model = _tiny.mlp(cls, distribution, optimizer=lambda: keras.optimizers.Adam(0.01))
        _tiny.update(model, distribution, x, y, batch)  # builds Adam's moments
        variables = model.weights + model.optimizer.variables
        before = [np.array(v.numpy()) for v in variables]
        _tiny.update(model, distribution, poisoned, y, batch)
        changed = sum(
            not np.array_equal(old, v.numpy(), equal_nan=True)
            for old, v in zip(before, variables)
        )
        return Side(changed == 0, changed)

    return measure(lambda: side(keras.Model)), measure(lambda: side(SafeDistributedModel))


PROBE = Probe(
    name="nonfinite-skip",
    checks=(
        "one Adam step on a batch holding a NaN: weights and optimizer variables "
        "changed (0 is correct)"
    ),
    run=run,
)
