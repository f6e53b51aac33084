"""Probe (JAX): the optimizer's `global_clipnorm` under `DataParallel`.

On TensorFlow stock Keras clips each replica's gradient before the
all-reduce. On JAX every array is global: XLA sums the gradient across the
devices inside the step, and the optimizer clips the whole gradient once, as
on one device, so stock Keras is correct here and both sides should match.
The figure is the norm of one SGD update divided by the norm of the update
on one device with the whole batch: 1.0 is correct. The measurement is
`shared_probes/clipping.py`.
"""

import functools

from keras_safe_dist.doctor.jax.probes import _tiny
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.shared_probes import clipping as shared

__all__ = ["PROBE"]

PROBE = Probe(
    name=shared.NAME,
    checks=(
        f"global_clipnorm={shared.CLIPNORM}: {shared.FIGURE} (1.0 is correct; stock "
        "clips the global gradient on JAX too)"
    ),
    run=functools.partial(shared.run, _tiny),
)
