"""Probe: equal-weight accumulation with an uneven last micro-batch.

Stock Keras's `gradient_accumulation_steps` averages the micro-batch
gradients with equal weights, so a short last micro-batch counts as much as
a full one. (It crashes under MirroredStrategy, see `optimizer-accumulation`,
so its side runs on one device.) SafeDistributedModel weights each sample
equally, on the replicas. One update: a micro-batch of 4 samples per
replica, then one of 2. The figure is the relative deviation of the update
from one big batch with the same samples: 0 is correct. The measurement is
`shared_probes/uneven_accumulation.py`.
"""

import functools

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.doctor.shared_probes import uneven_accumulation as shared

__all__ = ["PROBE"]

STEPS = 2

PROBE = Probe(
    name=shared.NAME,
    checks=(
        f"accumulation over {STEPS} micro-batches, the last half as big (stock on one "
        f"device): {shared.FIGURE}"
    ),
    run=functools.partial(
        shared.run, _tiny, steps=STEPS, full=4, last=2, stock_on_one_device=True
    ),
)
