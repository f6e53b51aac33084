"""JAX start-up for the JAX tests: two CPU devices, in a pytest process of their own.

The backend and the device count are fixed when keras and jax are imported, so
these tests cannot share a process with `tests/` (TensorFlow's backend). Run:

    python3 -m pytest -q tests_jax

A JAX user has no TensorFlow: in this process `import tensorflow` raises, as it
does where TensorFlow is not installed, so a test that reaches TensorFlow
fails here even on a machine that has it (subprocesses are not blocked).
"""

import importlib.util
import os
import sys


class _NoTensorFlow:
    """A `sys.meta_path` finder that refuses `tensorflow` and its submodules."""

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ModuleNotFoundError(f"No module named {name!r} (tests_jax: a JAX user has no TensorFlow)")
        return None


assert "tensorflow" not in sys.modules, "tests_jax must start in a process without TensorFlow"
# tests/refilling.py (NumPy and Keras only) serves both suites; after this
# folder, so `conftest` stays this one.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
# Whether subprocesses can run TensorFlow's backend (this process cannot).
TENSORFLOW_INSTALLED = importlib.util.find_spec("tensorflow") is not None
sys.meta_path.insert(0, _NoTensorFlow())

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

needs_tensorflow = pytest.mark.skipif(
    not TENSORFLOW_INSTALLED, reason="runs TensorFlow's backend in a subprocess; TensorFlow is not installed"
)

assert keras.backend.backend() == "jax", keras.backend.backend()
assert len(jax.devices()) == 2, jax.devices()


@pytest.fixture(params=[1, 2], ids=["1device", "2devices"])
def devices(request):
    """1: no distribution (one device); 2: `DataParallel` over both CPU devices."""
    if request.param == 1:
        yield 1
        return
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    with distribution.scope():
        yield 2


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.config.set_dtype_policy("float32")
    keras.distribution.set_distribution(None)


def one_device(run):
    """`run()` with no distribution (one device), whatever distribution the test set."""
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        return run()
    finally:
        keras.distribution.set_distribution(distribution)


def regression_data(samples, features=4, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = (x @ rng.normal(size=(features, outputs)) + 0.1).astype("float32")
    weights = rng.uniform(0.2, 2.0, size=(samples,)).astype("float32")
    return x, y, weights


class KeptAtEpochEnd(keras.callbacks.Callback):
    """Copies the list of batches a NaNOnsetDetector keeps at each epoch's end (after the detector's hook)."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def on_epoch_end(self, epoch, logs=None):
        self.kept.append(list(self.model._nan_link.watch.batches))
