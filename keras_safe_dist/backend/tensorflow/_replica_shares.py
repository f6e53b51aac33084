"""One batch given to `train_on_batch()`, `test_on_batch()` or `predict_on_batch()`, split across the replicas.

Keras's TensorFlow trainer hands such a batch to `strategy.run` whole, so every
replica trains on (or evaluates, or predicts) all of it: on 2 replicas a
`train_on_batch()` of 8 samples counts 16 (a `reduction="sum"` loss, its
gradient and `samples_per_update` doubled; a group of accumulated micro-batches
weighs it twice), and `predict_on_batch()` returns every row twice. `fit()`
splits each batch across the replicas; here the one batch is split the same
way, each replica of this worker taking a slice (sizes differing by at most
one, the first replicas taking the larger ones; a replica past the samples
takes an empty share, which the step handles). Under
`MultiWorkerMirroredStrategy` each worker's batch is its own, split across its
own replicas, as `fit()` does with per-worker data.
"""

import keras
import numpy as np
import tensorflow as tf

__all__ = ["local_replicas", "split", "splitting"]


def local_replicas(strategy):
    """The replicas on this worker (1 under the default strategy)."""
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy
        return 1


def split(strategy, data):
    """`data` (a batch: arrays, tensors, or nested structures of them) as one share per local replica.

    Returns `data` itself on one local replica.

    Raises:
        ValueError: when the arrays do not all hold the same number of samples.
    """
    replicas = local_replicas(strategy)
    if replicas == 1:
        return data
    data = keras.tree.map_structure(_as_splittable, data)
    leaves = [leaf for leaf in keras.tree.flatten(data) if _rank(leaf)]
    if not leaves:
        return data
    counts = {_samples(leaf) for leaf in leaves}
    if len(counts) > 1:
        raise ValueError(
            "SafeDistributedModel cannot split this batch across its "
            f"{replicas} replicas: its arrays hold different numbers of samples "
            f"({', '.join(str(c) for c in sorted(counts, key=str))}). Pass x, y and "
            "sample_weight with one row per sample each."
        )
    (count,) = counts
    if count is None:  # a batch dimension unknown here: nothing to split by
        return data
    sizes = [count // replicas + (1 if i < count % replicas else 0) for i in range(replicas)]
    starts = np.cumsum([0, *sizes]).tolist()

    def share(context):
        index = context.replica_id_in_sync_group % replicas
        start, stop = starts[index], starts[index + 1]
        return keras.tree.map_structure(lambda leaf: _slice(leaf, start, stop), data)

    return strategy.experimental_distribute_values_from_function(share)


def splitting(strategy, function):
    """`function` (a train or test function) splitting a plain one-batch input across the replicas.

    Keras passes `fit()`'s and `evaluate()`'s datasets as iterators, already
    split; `train_on_batch()` and `test_on_batch()` pass a generator of one
    batch, which is split here.
    """
    if local_replicas(strategy) == 1:
        return function

    def split_function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return function(iterator)
        return function(split(strategy, data) for data in iterator)

    return split_function


def _as_splittable(leaf):
    if leaf is None or isinstance(leaf, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor, np.ndarray)):
        return leaf
    return np.asarray(leaf)


def _rank(leaf):
    if leaf is None:
        return 0
    return len(leaf.shape)


def _samples(leaf):
    count = leaf.shape[0]
    return None if count is None else int(count)


def _slice(leaf, start, stop):
    if not _rank(leaf):
        return leaf
    if isinstance(leaf, tf.SparseTensor):
        shape = leaf.dense_shape
        return tf.sparse.slice(leaf, [start] + [0] * (len(leaf.shape) - 1), tf.concat([[stop - start], shape[1:]], 0))
    # Placed on the replica's device here, as fit()'s shares are.
    return leaf[start:stop] if isinstance(leaf, tf.RaggedTensor) else tf.convert_to_tensor(leaf[start:stop])
