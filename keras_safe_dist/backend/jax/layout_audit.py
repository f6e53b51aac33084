"""`JAX002`: the audit's finding for variables not laid out on the `keras.distribution` distribution.

The check and the repair are in `variable_layout.py`; this is the finding
`keras_safe_dist.audit()` reports, worded for a stock model (whose `fit()`
fails) or for `SafeDistributedModel` (which lays them out and warns). Only
imported on the JAX backend.
"""

from keras_safe_dist.backend.jax.train_step_layout import current_distribution
from keras_safe_dist.backend.jax.variable_layout import CAUSE
from keras_safe_dist.backend.jax.variable_layout import FIX
from keras_safe_dist.backend.jax.variable_layout import misplaced_variables
from keras_safe_dist.core import is_safe_model
from keras_safe_dist.findings import Finding

__all__ = ["layout_findings"]


def layout_findings(model):
    """`JAX002` when a variable of `model` is not laid out as the distribution says.

    Checks the model's variables, its optimizer's and its metrics' (those
    built so far) against the distribution in effect, when one spans several
    devices.

    Args:
        model: a built `keras.Model`.

    Returns:
        A list of at most one finding.
    """
    distribution = current_distribution()
    if distribution is None:
        return []
    wrong, summary = misplaced_variables(model, distribution)
    if not wrong:
        return []
    if is_safe_model(model):
        consequence = (
            "SafeDistributedModel lays them out on the distribution once, before its "
            "first step, and warns"
        )
    else:
        consequence = (
            "keras.Model.fit() fails on them with 'Received incompatible devices for "
            "jitted computation'"
        )
    return [
        Finding.of(
            "JAX002",
            f"model '{model.name}'",
            f"{summary}: {CAUSE}; {consequence}.",
            FIX,
        )
    ]
