"""`keras-safe-dist doctor`: stock Keras against SafeDistributedModel, one probe per defect.

Each probe trains the same tiny model on the same data with stock Keras and
with SafeDistributedModel on N logical CPU replicas, and reports for each
side whether it behaved correctly and the measured figure. On TensorFlow the
probes are `probes/` under a MirroredStrategy; on JAX they are `jax/probes/`,
run in a process of their own under `keras.distribution.DataParallel`. See
docs/doctor.md.

The names below load on first use: the records and the report import no
backend, the TensorFlow runner and its probes import TensorFlow, and a JAX
run must not.
"""

import importlib

# public name: the module that defines it
_EXPORTS = {
    "MIN_REPLICAS": "keras_safe_dist.doctor.runner",
    "PROBES": "keras_safe_dist.doctor.probes",
    "NotApplicable": "keras_safe_dist.doctor.result",
    "Probe": "keras_safe_dist.doctor.probe",
    "Result": "keras_safe_dist.doctor.result",
    "Side": "keras_safe_dist.doctor.probe",
    "exit_status": "keras_safe_dist.doctor.result",
    "header": "keras_safe_dist.doctor.render",
    "make_strategy": "keras_safe_dist.doctor.runner",
    "print_progress": "keras_safe_dist.doctor.result",
    "run_probes": "keras_safe_dist.doctor.result",
    "select": "keras_safe_dist.doctor.runner",
    "table": "keras_safe_dist.doctor.render",
    "to_json": "keras_safe_dist.doctor.render",
    "versions": "keras_safe_dist.doctor.runner",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
