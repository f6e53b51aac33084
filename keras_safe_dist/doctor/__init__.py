"""`keras-safe-dist doctor`: stock Keras against SafeDistributedModel, one probe per defect.

Each probe trains the same tiny model on the same data with stock Keras and
with SafeDistributedModel on N logical CPU replicas, and reports for each
side whether it behaved correctly and the measured figure. See docs/doctor.md.
"""

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probes import PROBES
from keras_safe_dist.doctor.render import header
from keras_safe_dist.doctor.render import table
from keras_safe_dist.doctor.render import to_json
from keras_safe_dist.doctor.runner import MIN_REPLICAS
from keras_safe_dist.doctor.runner import Result
from keras_safe_dist.doctor.runner import exit_status
from keras_safe_dist.doctor.runner import make_strategy
from keras_safe_dist.doctor.runner import run_probes
from keras_safe_dist.doctor.runner import select
from keras_safe_dist.doctor.runner import versions

__all__ = [
    "MIN_REPLICAS",
    "PROBES",
    "Probe",
    "Result",
    "Side",
    "exit_status",
    "header",
    "make_strategy",
    "run_probes",
    "select",
    "table",
    "to_json",
    "versions",
]
