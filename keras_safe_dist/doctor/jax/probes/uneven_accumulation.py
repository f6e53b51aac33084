"""Probe (JAX): accumulation over micro-batches of uneven size.

Stock Keras's optimizer `gradient_accumulation_steps` averages the
micro-batch gradients with equal weights, so a short last micro-batch counts
as much as a full one (on JAX it runs under `DataParallel`, unlike on
TensorFlow's MirroredStrategy). SafeDistributedModel weights every sample
equally. Both sides run on the devices with micro-batches of 8 x devices,
8 x devices and 1 x devices samples (16, 16, 2 on two devices: each splits
evenly, so only the weighting differs); the figure is the relative deviation
of the one update from one device's update on the whole batch: 0 is correct.
The measurement is `shared_probes/uneven_accumulation.py`.
"""

import functools

from keras_safe_dist.doctor.jax.probes import _tiny
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.shared_probes import uneven_accumulation as shared

__all__ = ["PROBE"]

STEPS = 3

PROBE = Probe(
    name=shared.NAME,
    checks=(
        f"accumulation over {STEPS} micro-batches of 8, 8 and 1 x devices samples (stock: "
        f"the optimizer's gradient_accumulation_steps): {shared.FIGURE}"
    ),
    run=functools.partial(shared.run, _tiny, steps=STEPS, full=8, last=1),
)
