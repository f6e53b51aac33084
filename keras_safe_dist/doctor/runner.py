"""Runs the doctor's probes on N logical CPU replicas and collects their results."""

import dataclasses
import platform
import time

import keras
import tensorflow as tf

import keras_safe_dist
from keras_safe_dist import _validate
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probes import PROBES

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


@dataclasses.dataclass(frozen=True)
class Result:
    """A probe's two sides and how long it took."""

    probe: Probe
    stock: Side
    safe: Side
    seconds: float

    @property
    def verdict(self):
        """`FAIL`, `skipped`, `fixed` (stock shows the defect) or `stock ok`."""
        if self.safe.ok is False:
            return "FAIL"
        if self.safe.ok is None:
            return "skipped"
        return "fixed" if self.stock.ok is False else "stock ok"


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
    if not names:
        return list(PROBES)
    known = {probe.name: probe for probe in PROBES}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"Unknown probe name(s): {', '.join(unknown)}. "
            f"Available: {', '.join(known)}. Pass names from that list to --only."
        )
    return [probe for probe in PROBES if probe.name in names]


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


def run_probes(probes, strategy, progress=None):
    """Runs each probe; `progress(index, total, probe, result)` before (None) and after.

    Returns:
        A list of `Result`, one per probe.
    """
    results = []
    for index, probe in enumerate(probes):
        if progress is not None:
            progress(index, len(probes), probe, None)
        start = time.perf_counter()
        stock, safe = probe.run(strategy)
        result = Result(probe, stock, safe, time.perf_counter() - start)
        results.append(result)
        if progress is not None:
            progress(index, len(probes), probe, result)
    return results


def exit_status(results):
    """0 when SafeDistributedModel passed every probe that ran, else 1."""
    return 1 if any(result.safe.ok is False for result in results) else 0
