"""Data that fills the same arrays again for each batch, for `tests/` and `tests_jax/`.

A generator or a `PyDataset` may stream data without allocating: each batch
is written into the arrays the last one was in. Backend-neutral (NumPy and
Keras only): `tests_jax/conftest.py` puts this folder on `sys.path` too.

The arrays are 64-byte aligned. TensorFlow 2.21's `from_generator` and
JAX's placement on a CPU take an aligned NumPy array without a copy and an
unaligned one with a copy (where NumPy's allocator puts a small array
varies from run to run), so there stock Keras reads a refilled aligned
array whenever it keeps one.
"""

import keras
import numpy as np

BATCH = 8


def aligned_empty(shape, dtype, alignment=64):
    """`np.empty(shape, dtype)` whose data starts on an `alignment`-byte boundary."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + size].view(dtype).reshape(shape)


def refilled(x, y=None):
    """Yields each batch of `BATCH` rows in the same arrays, filled again (`(x,)` when `y` is None)."""
    dataset = RefilledDataset(x, y)
    for index in range(len(dataset)):
        yield dataset[index]


class RefilledDataset(keras.utils.PyDataset):
    """A `PyDataset` whose `__getitem__` fills the same arrays again (`(x,)` when `y` is None)."""

    def __init__(self, x, y=None, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y
        self.x_buffer = aligned_empty((BATCH, x.shape[1]), x.dtype)
        self.y_buffer = None if y is None else aligned_empty((BATCH, y.shape[1]), y.dtype)

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        self.x_buffer[:] = self.x[rows]
        if self.y is None:
            return (self.x_buffer,)
        self.y_buffer[:] = self.y[rows]
        return self.x_buffer, self.y_buffer


def dense_model(model_class, initial=None):
    """A seeded Dense(1) on 4 features, compiled with SGD(0.1) and MSE; `initial` weights if given."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = model_class(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if initial is not None:
        model.set_weights(initial)
    return model
