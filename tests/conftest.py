"""Shared TensorFlow start-up: two logical CPU devices and one MirroredStrategy."""

import gc
import json
import os
import subprocess

# Level 3 also drops "failed call to cuInit ... (303)" on a machine without a
# GPU; the lines written while TensorFlow loads ignore any level.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

_SAVED_STDERR = os.dup(2)
with open(os.devnull, "w") as _null:
    os.dup2(_null.fileno(), 2)
try:  # as keras_safe_dist.core._quiet does; importing the package would load TensorFlow
    import tensorflow as tf  # noqa: E402
finally:
    os.dup2(_SAVED_STDERR, 2)
    os.close(_SAVED_STDERR)

_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _CPU, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# `fit()` leaves reference cycles that hold tf.data iterators. When the
# collector frees one long after its test, the iterator's destructor waits for
# its background threads: 25 s to 2 min at random points of the suite. So each
# test's garbage is collected when it ends, and what survives is frozen (every
# `fit()` keeps some graph objects alive, and a collection scans everything not
# frozen): each collection then takes milliseconds.
gc.collect()
gc.freeze()

_MIRRORED = None


def mirrored_strategy():
    """The one MirroredStrategy of this process (two logical CPU devices)."""
    global _MIRRORED
    if _MIRRORED is None:
        _MIRRORED = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return _MIRRORED


def strategy_for(replicas):
    """1 replica: TensorFlow's default strategy; 2: the shared MirroredStrategy."""
    if replicas == 1:
        return tf.distribute.get_strategy()
    assert replicas == 2, replicas
    return mirrored_strategy()


@pytest.fixture(params=[1, 2], ids=["1replica", "2replicas"])
def replicas(request):
    return request.param


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _collect_garbage():
    yield
    gc.collect()
    gc.freeze()


def regression_data(samples, features=4, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = (x @ rng.normal(size=(features, outputs)) + 0.1).astype("float32")
    weights = rng.uniform(0.2, 2.0, size=(samples,)).astype("float32")
    return x, y, weights


# A tensor whose norm is below this (a bias near zero) is compared at this
# scale: float32 rounding of its few elements is ~1e-8 absolute, which a
# norm of 1e-3 would turn into a relative error above 1e-5.
NORM_FLOOR = 1e-2


def relative_error(expected, actual):
    """Largest ||expected - actual|| / max(||expected||, NORM_FLOOR) over the weight tensors."""
    return max(
        float(np.linalg.norm(e - a) / max(np.linalg.norm(e), NORM_FLOOR))
        for e, a in zip(expected, actual)
    )


class SumCounter(keras.layers.Layer):
    """Adds 1 each step to an on-write variable with `sum` aggregation (AGG003)."""

    def build(self, shape):
        self.count = self.add_weight(
            shape=(), initializer="zeros", trainable=False, aggregation="sum", name="count"
        )

    def call(self, x):
        self.count.assign_add(1.0)
        return x


def strict_json(text):
    """`json.loads` that refuses `NaN`, `Infinity` and `-Infinity`, as RFC 8259 does."""

    def refuse(token):
        raise ValueError(f"not RFC 8259 JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(size)`: a folder on a tmpfs of `size` (e.g. "512k"), a disk that fills up.

    Needs root (mount); skips with the reason where the machine cannot mount one.
    """
    mounted = []

    def mount(size):
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], check=True)
