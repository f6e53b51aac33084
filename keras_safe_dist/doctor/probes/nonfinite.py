"""Probe: an update whose gradient is not finite.

Stock Keras applies a NaN gradient: the weights and Adam's moments become
NaN and the step counter moves. SafeDistributedModel (`skip_nonfinite=True`,
the default) skips the update on every replica together. The figure is how
many of the model's weights and optimizer variables one step with a NaN
input changed: 0 is correct. The measurement is `shared_probes/nonfinite.py`.
"""

import functools

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.doctor.shared_probes import nonfinite as shared

__all__ = ["PROBE"]

PROBE = Probe(name=shared.NAME, checks=shared.CHECKS, run=functools.partial(shared.run, _tiny))
