"""A Python generator's or a `PyDataset`'s batches, copied where Keras keeps them while it runs on.

A generator, or a `keras.utils.PyDataset`'s `__getitem__`, may fill the same
arrays again for each batch, to stream data without allocating. Keras keeps
references to such batches while the data runs ahead, so it trains on other
data than it gave:

- Keras's generator adapter reads the first batches ahead, to learn their
  shapes (2: `_compat.generator_read_ahead()`), and trains on them later; the
  first batch then holds the second's data. Both backends.
- On TensorFlow, `tf.data.Dataset.from_generator` takes NumPy arrays without a
  copy and prefetches: steps read arrays the generator has filled again since.
  Keras feeds a `PyDataset` through it too.
- On JAX on a CPU, Keras places a batch's shards under `DataParallel`
  without a copy, and the step runs after the generator moved on.

`fresh_batches` copies each NumPy array of such batches as the generator gives
it: every batch on TensorFlow (on tf.data's thread, not the one that
dispatches the steps) and on a JAX CPU; on a JAX accelerator, where Keras
places each later batch on the device as it reads it, the batches Keras reads
ahead only (not yet measured on a GPU: docs/model.md). A `PyDataset`'s
batches are copied on TensorFlow and on a JAX CPU (Keras reads none of them
ahead to train on), unless it runs in worker processes, whose batches reach
the step already copied. Other leaves (JAX and TensorFlow tensors, which
cannot change, Python numbers) pass as they are.
"""

import types

import keras
import numpy as np

from keras_safe_dist.core import on_jax


def fresh_batches(data, read_ahead):
    """`data`, or, if it is a generator or a `PyDataset`, the same batches with their NumPy arrays copied.

    Args:
        data: what `fit()`, `evaluate()` or `predict()` received as `x` or
            `validation_data`.
        read_ahead: how many batches Keras reads ahead of the first step
            (`_compat.generator_read_ahead()`).
    """
    if isinstance(data, types.GeneratorType):
        return _copying(data, None if _copies_every_batch() else read_ahead)
    if (
        isinstance(data, keras.utils.PyDataset)
        and not isinstance(data, _CopiedPyDataset)
        and not data.use_multiprocessing
        and _copies_every_batch()
    ):
        return _CopiedPyDataset(data)
    return data


def _copying(generator, count):
    """`generator`'s batches, the first `count` copied (every one if `count` is None)."""
    for index, batch in enumerate(generator):
        yield _copied(batch) if count is None or index < count else batch


def _copies_every_batch():
    if not on_jax():
        return True
    import jax  # the backend in use: imported by Keras already

    return jax.devices()[0].platform == "cpu"


def _copied(batch):
    return keras.tree.map_structure(
        lambda leaf: np.array(leaf) if isinstance(leaf, np.ndarray) else leaf, batch
    )


class _CopiedPyDataset(keras.utils.PyDataset):
    """`dataset`'s batches, their NumPy arrays copied as `__getitem__` gives them.

    Keras sees the same workers, length and epoch hooks as `dataset`'s.
    """

    def __init__(self, dataset):
        super().__init__(
            workers=dataset.workers,
            use_multiprocessing=dataset.use_multiprocessing,
            max_queue_size=dataset.max_queue_size,
        )
        self.dataset = dataset

    def __getitem__(self, index):
        return _copied(self.dataset[index])

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()
