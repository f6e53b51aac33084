"""The doctor's probes, one module per known defect, in the order they run."""

from keras_safe_dist.doctor.probes import clipping
from keras_safe_dist.doctor.probes import empty_share
from keras_safe_dist.doctor.probes import identity_nan
from keras_safe_dist.doctor.probes import multi_worker
from keras_safe_dist.doctor.probes import nonfinite
from keras_safe_dist.doctor.probes import optimizer_accumulation
from keras_safe_dist.doctor.probes import sum_aggregation
from keras_safe_dist.doctor.probes import uneven_accumulation
from keras_safe_dist.doctor.probes import uneven_first_batch
from keras_safe_dist.doctor.probes import uneven_split

__all__ = ["PROBES"]

PROBES = (
    clipping.PROBE,
    optimizer_accumulation.PROBE,
    uneven_accumulation.PROBE,
    uneven_split.PROBE,
    uneven_first_batch.PROBE,
    empty_share.PROBE,
    multi_worker.PROBE,
    identity_nan.PROBE,
    sum_aggregation.PROBE,
    nonfinite.PROBE,
)
