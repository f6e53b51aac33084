"""The doctor on TensorFlow: N logical CPU replicas, a MirroredStrategy over them, the probes."""

import platform

import keras

import keras_safe_dist
from keras_safe_dist.core import _validate
from keras_safe_dist.core._lazy import tensorflow as tf
from keras_safe_dist.doctor.probes import PROBES
from keras_safe_dist.doctor.result import Result
from keras_safe_dist.doctor.result import choose
from keras_safe_dist.doctor.result import exit_status
from keras_safe_dist.doctor.result import run_probes

__all__ = [
    "MIN_REPLICAS",
    "Result",
    "exit_status",
    "make_strategy",
    "run_probes",
    "select",
    "versions",
]

# The defects need several replicas; one would make every probe trivially pass.
MIN_REPLICAS = 2


def versions():
    """The versions the doctor ran with."""
    return {
        "python": platform.python_version(),
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "keras_safe_dist": keras_safe_dist.__version__,
    }


def select(names=None):
    """The probes named in `names` (all when None), in the order they run.

    Raises:
        ValueError: for an unknown name, listing the available ones.
    """
    return choose(PROBES, names)


def make_strategy(replicas):
    """Splits the CPU into `replicas` logical devices; a MirroredStrategy over them.

    Call before TensorFlow runs any op: logical devices cannot be added
    afterwards. A process that already has exactly `replicas` logical CPU
    devices is accepted as it is.

    Raises:
        ValueError: for `replicas` that is not an integer >= 2.
        RuntimeError: when TensorFlow is already initialised with another
            number of logical CPU devices.
    """
    replicas = _validate.integer_at_least("replicas", replicas, MIN_REPLICAS)
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    except RuntimeError:
        present = len(tf.config.list_logical_devices("CPU"))
        if present != replicas:
            raise RuntimeError(
                f"The doctor needs {replicas} logical CPU devices, but TensorFlow "
                f"was already initialised with {present}. Run it in a fresh "
                "process (`keras-safe-dist doctor`)."
            ) from None
    devices = [device.name for device in tf.config.list_logical_devices("CPU")]
    return tf.distribute.MirroredStrategy(devices[:replicas])
