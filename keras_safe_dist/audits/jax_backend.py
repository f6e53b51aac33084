"""The audits on Keras's JAX backend: what ran, what has no meaning there, said once.

Under `keras.distribution` every variable is one global array laid out over
the devices, and XLA reduces the gradient inside the compiled step. So the
checks of tf.distribute's machinery find nothing real on JAX: a variable's
cross-replica aggregation (`AGG*`), the strategy scope objects were built in
(`SCOPE*`), per-replica copies of non-trainable state (`MODE002`, `MODE004`)
and the stock model's per-replica update (`DIST*`: clipping before the
all-reduce, per-replica loss weighting). An audit on JAX reports, in one
`JAX001` finding of severity `info`, the checks it ran and the ones that do
not apply, with the reason in JAX's terms. The checks that keep their meaning
(`MODE001`, `MODE003`) run as on TensorFlow, and one has a JAX form:
variables created before the distribution was set (`JAX002`, from
`keras_safe_dist/backend/jax/layout_audit.py`).
"""


from keras_safe_dist.core import on_jax
from keras_safe_dist.findings import Finding

__all__ = ["NOT_ON_JAX", "RUN_ON_JAX", "layout_findings", "not_applicable"]

# check family: (its codes, why it has no meaning on JAX)
NOT_ON_JAX = {
    "aggregation": (
        "AGG*",
        "variables are global arrays, not per-replica copies that tf.distribute aggregates",
    ),
    "scope": (
        "SCOPE*",
        "there is no strategy scope; a variable takes its layout from the keras.distribution "
        "distribution set when it is created, which audit() checks as JAX002",
    ),
    "stock model": (
        "DIST*",
        "XLA reduces the whole batch's gradient inside the step, so a stock model clips and "
        "weights the loss as on one device",
    ),
    "replica copies": (
        "MODE002, MODE004",
        "non-trainable state is one global array, with no per-replica copies to differ",
    ),
}

# audit: the checks it runs on JAX
RUN_ON_JAX = {
    "audit()": "MODE003 and JAX002",
    "TrainingModeAudit": "MODE001 and MODE003",
}


def not_applicable(subject, families):
    """The `JAX001` finding of an audit on JAX: what it ran, what does not apply and why.

    Args:
        subject: the audit, e.g. `"audit()"` or `"ScopeAudit"`; the checks
            it runs on JAX are those of `RUN_ON_JAX` (none when absent).
        families: keys of `NOT_ON_JAX`, the checks it skips.

    Returns:
        A `Finding` of severity `info`.

    Example:

    ```python
    finding = not_applicable("TrainingModeAudit", ["replica copies"])
    print(finding.message)
    # On JAX, TrainingModeAudit ran MODE001 and MODE003; MODE002, MODE004 (replica
    # copies) are tf.distribute's checks and do not apply.
    ```
    """
    ran = RUN_ON_JAX.get(subject)
    codes = ", ".join(f"{NOT_ON_JAX[family][0]} ({family})" for family in families)
    done = f"On JAX, {subject} ran {ran}" if ran else f"On JAX, {subject} ran no check"
    # One sentence: `report` merges an audit's JAX001 with the others' into one row.
    # The reasons, in JAX's terms, are `NOT_ON_JAX`'s, listed in docs/audits.md.
    return Finding.of(
        "JAX001",
        subject,
        f"{done}; {codes} are tf.distribute's checks and do not apply.",
        "Nothing to fix: those checks run on the TensorFlow backend under a tf.distribute "
        "strategy (why each does not apply on JAX: docs/audits.md, 'On the JAX backend').",
    )


def layout_findings(model):
    """`JAX002` for the variables of `model` not laid out as the distribution says (JAX only).

    Args:
        model: a built `keras.Model`.

    Returns:
        A list of at most one finding; empty off JAX, or when no distribution
        over several devices is set.
    """
    if not on_jax():
        return []
    from keras_safe_dist.backend.jax import layout_audit

    return layout_audit.layout_findings(model)
