"""The JAX doctor's probes, one module per defect that exists on JAX, in the order they run.

`NOT_APPLICABLE` names the TensorFlow probes that have no JAX meaning, with
the reason; the report lists them below the table.
"""

from keras_safe_dist.doctor.jax.probes import clipping
from keras_safe_dist.doctor.jax.probes import empty_share
from keras_safe_dist.doctor.jax.probes import nonfinite
from keras_safe_dist.doctor.jax.probes import uneven_accumulation
from keras_safe_dist.doctor.jax.probes import uneven_batch
from keras_safe_dist.doctor.result import NotApplicable

__all__ = ["NOT_APPLICABLE", "PROBES"]

PROBES = (
    clipping.PROBE,
    uneven_accumulation.PROBE,
    uneven_batch.PROBE,
    empty_share.PROBE,
    nonfinite.PROBE,
)

NOT_APPLICABLE = (
    NotApplicable(
        "optimizer-accumulation",
        "no merge_call on JAX: the optimizer's gradient_accumulation_steps runs under "
        "DataParallel; how it weights uneven micro-batches is uneven-accumulation",
    ),
    NotApplicable(
        "uneven-replica-split",
        "JAX arrays are global, so a batch the devices divide is exact in stock Keras; "
        "one they do not divide crashes it: uneven-batch",
    ),
    NotApplicable(
        "uneven-first-batch",
        "Keras's JAX trainer builds the model from the global batch; an indivisible "
        "first batch is uneven-batch",
    ),
    NotApplicable(
        "multi-worker-fit",
        "MultiWorkerMirroredStrategy is TensorFlow's; JAX's multi-process runs "
        "(jax.distributed) are not probed",
    ),
    NotApplicable(
        "identity-nan",
        "the Keras 3.7-3.9 NaN came from tf.distribute's on-write sum aggregation; "
        "Keras's JAX trainer keeps no per-replica copies of its variables",
    ),
    NotApplicable(
        "sum-aggregation",
        "a variable's aggregation only matters to tf.distribute: on JAX an "
        "assign_add writes the one global value",
    ),
)
