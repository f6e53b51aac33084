"""A Python generator's or a `PyDataset`'s batches, copied as it gives them.

A generator, or a `keras.utils.PyDataset`'s `__getitem__`, may fill the same
arrays again for each batch, to stream data without allocating. Keras keeps
references to such batches while the data runs on, so it trains on other
data than it was given:

- Keras's generator adapter reads the first 2 batches ahead, to learn their
  shapes, and trains on them later; the first batch then holds the second's
  data. Both backends.
- On TensorFlow, `tf.data.Dataset.from_generator` takes NumPy arrays without a
  copy and prefetches: steps read arrays filled again since. Keras feeds a
  `PyDataset` through it too.
- On JAX, `jax.device_put` may alias a NumPy array (on a CPU it does: under
  `DataParallel` the step then runs after the data moved on), and on an
  accelerator Keras places each batch one step ahead, its transfer allowed to
  read the array after `device_put` returns while the data fills it again.

`fresh_batches` copies each NumPy array of every batch as the data gives it,
on every backend and platform: one pass over the batch's memory, on tf.data's
thread on TensorFlow, on the thread that runs the steps on JAX. A `PyDataset`
that runs in worker processes (`use_multiprocessing=True`, `workers` above 0)
is passed as given: its batches reach the step already copied. Other leaves
(JAX and TensorFlow tensors, which cannot change, Python numbers) pass as they
are.
"""

import types

import keras
import numpy as np


def fresh_batches(data):
    """`data`, or, if it is a generator or a `PyDataset`, the same batches with their NumPy arrays copied.

    Args:
        data: what `fit()`, `evaluate()` or `predict()` received as `x` or
            `validation_data`.
    """
    if isinstance(data, types.GeneratorType):
        return _copying(data)
    if (
        isinstance(data, keras.utils.PyDataset)
        and not isinstance(data, _CopiedPyDataset)
        # Keras starts worker processes only with `workers > 0`; their
        # batches arrive pickled, already copies.
        and not (data.use_multiprocessing and data.workers > 0)
    ):
        return _CopiedPyDataset(data)
    return data


def _copying(generator):
    for batch in generator:
        yield copied(batch)


def copied(batch):
    """`batch` with its NumPy arrays copied; other leaves (tensors, which cannot change) as they are."""
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
        return copied(self.dataset[index])

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()
