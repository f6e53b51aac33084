"""The audits on Keras's JAX backend: which checks have no meaning there, said once.

Under `keras.distribution` every variable is one global array laid out over
the devices, created wherever the code runs, and XLA reduces the gradient
inside the compiled step. So the checks of tf.distribute's machinery find
nothing real on JAX: a variable's cross-replica aggregation (`AGG*`), the
strategy scope objects were built in (`SCOPE*`), per-replica copies of
non-trainable state (`MODE002`, `MODE004`) and the stock model's
per-replica update (`DIST*`: clipping before the all-reduce, per-replica loss
weighting). Instead of running them, an audit on JAX reports one `JAX001`
finding of severity `info` naming what it skipped; the checks that keep
their meaning (`MODE001`, `MODE003`) run as on TensorFlow.
"""

import keras

from keras_safe_dist.findings import Finding

__all__ = ["NOT_ON_JAX", "not_applicable", "on_jax"]

# check family: why it has no meaning on JAX
NOT_ON_JAX = {
    "aggregation": "variables are global arrays, not per-replica copies aggregated by tf.distribute",
    "scope": "there is no strategy scope: keras.distribution lays out a variable wherever it is created",
    "stock model": (
        "XLA reduces the whole batch's gradient inside the step, so a stock model clips and "
        "weights the loss as on one device"
    ),
    "replica copies": "non-trainable state is one global array, with no per-replica copies to differ",
}


def on_jax():
    """Whether Keras runs on its JAX backend."""
    return keras.backend.backend() == "jax"


def not_applicable(subject, families):
    """The `JAX001` finding for the check `families` an audit skips on JAX.

    Args:
        subject: what was audited, e.g. `"audit()"` or `"ScopeAudit"`.
        families: keys of `NOT_ON_JAX`.

    Returns:
        A `Finding` of severity `info`.

    Example:

    ```python
    finding = not_applicable("ScopeAudit", ["scope"])
    print(finding.code, finding.severity)  # JAX001 info
    ```
    """
    reasons = "; ".join(f"{family}: {NOT_ON_JAX[family]}" for family in families)
    return Finding.of(
        "JAX001",
        subject,
        f"the {', '.join(families)} checks apply to tf.distribute only and were not run on "
        f"Keras's JAX backend ({reasons}).",
        "Nothing to fix; to run these checks, train on the TensorFlow backend under a "
        "tf.distribute strategy.",
    )
