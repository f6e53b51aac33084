"""A Python generator's batches, copied where Keras keeps them while the generator runs on.

A generator may fill the same arrays again for each batch, to stream data
without allocating. Keras keeps references to a generator's batches while the
generator runs ahead, so such a generator trains on other data than it gave:

- Keras's generator adapter reads the first batches ahead, to learn their
  shapes (2: `_compat.generator_read_ahead()`), and trains on them later; the
  first batch then holds the second's data. Both backends.
- On TensorFlow, `tf.data.Dataset.from_generator` takes NumPy arrays without a
  copy and prefetches: steps read arrays the generator has filled again since.
- On JAX on a CPU, Keras places a batch's shards under `DataParallel`
  without a copy, and the step runs after the generator moved on.

`fresh_batches` copies each NumPy array of such batches as the generator gives
it: every batch on TensorFlow (on tf.data's thread, not the one that
dispatches the steps) and on a JAX CPU; on a JAX accelerator, where Keras
places each later batch on the device as it reads it, the batches Keras reads
ahead only (not yet measured on a GPU: docs/model.md). Other
leaves (JAX and TensorFlow tensors, which cannot change, Python numbers) pass
as they are.
"""

import types

import keras
import numpy as np

from keras_safe_dist.core import on_jax


def fresh_batches(data, read_ahead):
    """`data`, or, if it is a generator, a generator of its batches with their NumPy arrays copied.

    Args:
        data: what `fit()`, `evaluate()` or `predict()` received as `x` or
            `validation_data`.
        read_ahead: how many batches Keras reads ahead of the first step
            (`_compat.generator_read_ahead()`).
    """
    if not isinstance(data, types.GeneratorType):
        return data
    return _copying(data, None if _copies_every_batch() else read_ahead)


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
