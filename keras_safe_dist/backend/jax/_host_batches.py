"""Each batch as the data gave it, beside the batch Keras placed on the devices.

On an accelerator, and under a `keras.distribution` anywhere, Keras's JAX
epoch iterator places each batch on the devices before the step that trains
on it. A NaNOnsetDetector keeps the batches of the last steps for its replay
(`nan_watch.OnsetWatch.record_batch`). Kept on the devices, each one is
freed when a later step pushes it out, on the thread that dispatches the
steps: about 5% of a dispatch-bound step (docs/benchmarks.md, "Device arrays
on the dispatching thread"). Kept as the host arrays the data gave, they are
freed for next to nothing, and take host memory instead of device memory.

`HostBatchesEpochIterator` is Keras's JAX epoch iterator; the iterator it
gives the train function also tells, after each batch, the host batch it
came from (`host_batch`). In one process only: with several, each step's
global batch is built on the devices from every process's share
(`_process_batch`), and the detector keeps that one.

Arrays and tf.data give new arrays for each batch
(`_jax_compat.host_batches_are_fresh`). A generator or a `PyDataset` may
fill one buffer again for each batch, so `SafeDistributedModel.fit()`, the
only caller of `host_batches_told`, hands Keras a copy of each of their
batches (`core/_generators.py`); a `PyDataset` in worker processes gives
copies itself. Those host batches are kept too. For other data (a grain or
torch loader), on an accelerator, the iterator tells nothing and the
detector keeps the batch Keras placed: a copy on the device, complete once
its step ran. On a CPU that is no copy: a batch placed sharded shares the
host buffer, and an unsharded one is copied later, asynchronously. There the
iterator tells a host copy of each batch (a memory copy a step, on a CPU).
"""

import collections
import contextlib

import jax

from keras_safe_dist.backend.jax import _compat as _jax_compat
from keras_safe_dist.core import _generators

__all__ = ["HostBatchesEpochIterator", "host_batches_told"]


def host_batches_told():
    """While open (and in one process), Keras's JAX loops use `HostBatchesEpochIterator`."""
    if jax.process_count() > 1:
        return contextlib.nullcontext()
    return _jax_compat.epoch_iterator_replaced(HostBatchesEpochIterator)


class HostBatchesEpochIterator(_jax_compat.epoch_iterator_class()):
    """Keras's JAX epoch iterator; its iterators also tell each batch's host arrays."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pulled = None
        fresh = _jax_compat.host_batches_are_fresh(self) or (
            # Copied as given by SafeDistributedModel.fit() (core/_generators.py).
            _jax_compat.reads_generator_or_py_dataset(self)
        )
        self._copied = not fresh and jax.devices()[0].platform == "cpu"
        self._tells = fresh or self._copied
        if self._tells:
            _jax_compat.record_host_batches(self, self._record)

    def _record(self, batch):
        if self._pulled is not None:
            self._pulled.append(_generators.copied(batch) if self._copied else batch)

    def _get_iterator(self):
        if not self._tells:
            return super()._get_iterator()
        # Keras reads one batch ahead of the one it yields on an accelerator:
        # the host batches wait here, in order, for their placed batches.
        self._pulled = collections.deque()
        return _Told(super()._get_iterator(), self._pulled)


class _Told:
    """An iterator over placed batches that tells the host batch of the last one (`host_batch`)."""

    def __init__(self, placed, pulled):
        self.placed = iter(placed)
        self.pulled = pulled
        self.host_batch = None

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.placed)
        self.host_batch = self.pulled.popleft() if self.pulled else batch
        return batch

