"""Probe: optimizer clipping applied before the cross-replica all-reduce.

Stock Keras clips each replica's share of the gradient (`global_clipnorm` on
the optimizer) before the replicas' gradients are summed, so the update can
be up to `replicas` times longer than the clipped norm. SafeDistributedModel
clips the reduced gradient once. The figure is the norm of one SGD update
divided by the norm of the update stock Keras makes on one device with the
whole batch: 1.0 is correct. The measurement is `shared_probes/clipping.py`.
"""

import functools

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probes import _tiny
from keras_safe_dist.doctor.shared_probes import clipping as shared

__all__ = ["PROBE"]

PROBE = Probe(
    name=shared.NAME,
    checks=f"global_clipnorm={shared.CLIPNORM}: {shared.FIGURE} (1.0 is correct)",
    run=functools.partial(shared.run, _tiny),
)
