"""Each process's share of a global batch, when several JAX processes feed their own data.

Under `jax.distributed` every process passes its own arrays to `fit()`,
`evaluate()` and `predict()`, and Keras builds each step's global batch from
the processes' local batches. Keras needs those to be equal: shard sizes that
differ (32 and 33 samples) leave one process with a batch the others do not
have, and both wait for good in the step's collective.

Here the processes agree on every step's local batch sizes first: once per
epoch iterator when every process knows its sizes in advance (arrays, and
datasets whose batch size and length are known), at each step otherwise.
The step's global batch is then the union of the local batches, in process
order: process 0's rows, then process 1's, and so on. A process that ran out
of batches contributes an empty share. Where every process has the same
number of samples, divisible by its devices, the batch is placed as Keras
places it (sharded, no extra cost). Otherwise each process pads its batch,
the padded batches form one sharded array, and a compiled gather keeps the
real rows, placed whole on every device: every device then computes the
step on the real global batch, the one-device result (BatchNormalization
included), without the data-parallel speed-up for that step.
"""

import collections
import contextlib
import threading

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_safe_dist.backend.jax import _compat as _jax_compat

_state = threading.local()


def last_step():
    """`(sizes, process)` of the step the current iterator yielded last, or None."""
    return getattr(_state, "last", None)


def sizes_of(batch):
    """The local batch sizes, by process, of a global batch this module built; None otherwise."""
    key = id(_first_leaf(batch))
    for built, sizes in reversed(getattr(_state, "recent", ())):
        if built == key:
            return sizes
    return None


def process_rows(sizes, rows):
    """`[(process, row of its local batch), ...]` for `rows` of a global batch of `sizes`."""
    starts = np.cumsum((0,) + tuple(sizes))
    located = []
    for row in rows:
        process = int(np.searchsorted(starts, row, side="right")) - 1
        located.append((process, int(row - starts[process])))
    return located


def replicated(batch):
    """`batch` with each global array placed whole on every device, so every process can read it.

    Every process must call it on the same batch (it gathers the shards).
    """

    def whole(leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or sharding.is_fully_replicated or not hasattr(sharding, "mesh"):
            return leaf
        spec = jax.sharding.PartitionSpec()
        return _gather_all(jax.sharding.NamedSharding(sharding.mesh, spec))(leaf)

    return keras.tree.map_structure(whole, batch)


def _gather_all(sharding):
    key = ("all", sharding)
    if key not in _gathers:
        _gathers[key] = jax.jit(lambda array: array, out_shardings=sharding)
    return _gathers[key]


def _first_leaf(batch):
    leaves = [leaf for leaf in keras.tree.flatten(batch) if leaf is not None]
    return leaves[0] if leaves else None


def agreed_iterators():
    """While open (and with several processes), Keras's JAX loops use `SharedEpochIterator`."""
    if jax.process_count() == 1:
        return contextlib.nullcontext()
    return _jax_compat.epoch_iterator_replaced(SharedEpochIterator)


_KerasEpochIterator = _jax_compat.epoch_iterator_class()


class SharedEpochIterator(_jax_compat.InterruptedWarningWhen, _KerasEpochIterator):
    """Keras's JAX epoch iterator, over the global batches every process agreed on."""

    def __init__(self, *args, **kwargs):
        self._template_args = (args, kwargs)
        self._agreed_end = False
        super().__init__(*args, **kwargs)
        self._schedule = _known_schedule(self.data_adapter)
        self._global_batches()

    def input_interrupted(self):
        """Whether Keras's "Your input ran out of data" warning is true.

        Not where every process's data ended at the step they agreed on and
        each knows its own length (a PyDataset): the epoch ended, as it does
        in one process without the warning. A generator of unknown length
        warns, as in one process.
        """
        agreed, self._agreed_end = self._agreed_end, False
        return not (agreed and self.data_adapter.num_batches is not None)

    def _global_batches(self):
        # Every process runs the same number of steps: the most any has.
        if self._schedule is not None:
            self._num_batches = len(self._schedule)
        else:
            self._num_batches = None

    def reset(self):
        super().reset()
        self._global_batches()

    def _get_distributed_iterator(self, distribution):
        process = jax.process_index()
        local = iter(self.data_adapter.get_jax_iterator())
        template = None
        step = 0
        while True:
            if self._schedule is not None:
                if step == len(self._schedule):
                    return
                sizes = self._schedule[step]
                batch = next(local) if sizes[process] else None
            else:
                batch = next(local, None)
                sizes = _exchange([_samples(batch)])[:, 0].tolist()
                if not any(sizes):
                    self._agreed_end = True
                    return
            if batch is not None and template is None:
                template = keras.tree.map_structure(_empty_like, batch)
            if batch is None:
                if template is None:
                    template = self._empty_template()
                batch = template
            step += 1
            _state.last = (tuple(sizes), process)
            placed = _global_batch(batch, sizes, distribution)
            if not hasattr(_state, "recent"):
                _state.recent = collections.deque(maxlen=64)
            # For NaNOnsetDetector: which process each row of this batch came from.
            _state.recent.append((id(_first_leaf(placed)), tuple(sizes)))
            yield placed

    def _empty_template(self):
        """A batch of no samples, structured as this process's adapter yields them."""
        args, kwargs = self._template_args
        names = ("x", "y", "sample_weight", "batch_size", "steps_per_epoch", "shuffle", "class_weight")
        given = dict(zip(names, args), **kwargs)
        arrays = {k: given.get(k) for k in ("x", "y", "sample_weight")}
        try:
            one = keras.tree.map_structure(_one_row, arrays)
            adapter = _KerasEpochIterator(
                **one, batch_size=1, class_weight=given.get("class_weight")
            ).data_adapter
            batch = next(iter(adapter.get_jax_iterator()))
        except Exception as error:
            raise ValueError(
                "This process has no samples for a step the other processes train on, "
                "and its data gives no shape for an empty share. Pass arrays "
                "(NumPy or JAX) with 0 rows and the right trailing shape, e.g. "
                f"x[:0]. Received: x of type {type(given.get('x')).__name__}"
            ) from error
        return keras.tree.map_structure(_empty_like, batch)


def _known_schedule(adapter):
    """Every step's local batch sizes on every process, or None where a process cannot know its own."""
    counts = [_known(adapter, "num_batches"), _known(adapter, "batch_size"), _known(adapter, "partial_batch_size") or 0]
    known = all(isinstance(n, int) for n in counts[:2])
    everyone = _exchange([int(known)] + [n if isinstance(n, int) else -1 for n in counts])
    if not everyone[:, 0].all():
        return None
    steps = int(everyone[:, 1].max())
    if steps == 0:
        raise ValueError(
            f"No process has samples: each of the {len(everyone)} processes received "
            "data that holds none, so there is nothing to run. Pass each process its "
            "own rows; at least one process needs one sample."
        )
    schedule = []
    for step in range(steps):
        sizes = []
        for _, batches, batch_size, partial in everyone:
            if step < batches - 1 or (step == batches - 1 and not partial):
                sizes.append(int(batch_size))
            elif step == batches - 1:
                sizes.append(int(partial))
            else:
                sizes.append(0)
        schedule.append(tuple(sizes))
    return schedule


def _known(adapter, name):
    """An adapter's `num_batches`, `batch_size` or `partial_batch_size`; None where it cannot say."""
    try:
        return getattr(adapter, name)
    except NotImplementedError:  # Keras's base adapter, for Python generators and PyDatasets
        return None


def _exchange(values):
    """`values` (ints) of every process, one row per process in process order."""
    return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))


def _samples(batch):
    if batch is None:
        return 0
    for leaf in keras.tree.flatten(batch):
        if leaf is not None and getattr(leaf, "shape", None):
            return int(leaf.shape[0])
    return 0


def _empty_like(leaf):
    if leaf is None:
        return None
    return np.zeros((0,) + tuple(leaf.shape[1:]), dtype=leaf.dtype)


def _one_row(leaf):
    if leaf is None:
        return None
    return np.zeros((1,) + tuple(np.shape(leaf)[1:]), dtype=np.asarray(leaf[:0]).dtype)


def _global_batch(batch, sizes, distribution):
    def place(leaf):
        if leaf is None:
            return None
        layout = distribution.get_data_layout(leaf.shape).backend_layout
        return _global_leaf(leaf, layout, sizes)

    return keras.tree.map_structure(place, batch)


def _global_leaf(leaf, layout, sizes):
    per_process = _parts(layout) // jax.process_count()
    if per_process == 0:
        raise ValueError(
            f"The distribution splits the batch into {_parts(layout)} part(s) over "
            f"{jax.process_count()} processes: processes would share a part of the batch, "
            "and each passes its own rows. Lay the batch axis of the device mesh over "
            "every process: e.g. DeviceMesh((processes, devices_per_process), "
            "('batch', 'model')) for ModelParallel, so that each process holds its own "
            f"part. Received: a data layout {layout.spec} on a mesh {dict(layout.mesh.shape)}."
        )
    if len(set(sizes)) == 1 and sizes[0] % per_process == 0:
        return jax.make_array_from_process_local_data(layout, leaf)
    padded_size = -(-max(sizes) // per_process) * per_process
    padded = np.zeros((padded_size,) + tuple(leaf.shape[1:]), dtype=leaf.dtype)
    padded[: leaf.shape[0]] = np.asarray(leaf)
    sharded = jax.make_array_from_process_local_data(layout, padded)
    rows = np.concatenate(
        [start + np.arange(size) for start, size in zip(_starts(sharded), sizes)]
    ).astype(np.int32)
    replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    return _gather(replicated)(sharded, rows)


def _parts(layout):
    spec = layout.spec
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    parts = 1
    for axis in axes:
        if axis is not None:
            parts *= layout.mesh.shape[axis]
    return parts


def _starts(array):
    """The first global row of each process's block of `array`, in process order."""
    starts = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        start = index[0].start or 0
        process = device.process_index
        starts[process] = min(start, starts.get(process, start))
    return [starts[p] for p in range(jax.process_count())]


_gathers = {}


def _gather(sharding):
    if sharding not in _gathers:
        _gathers[sharding] = jax.jit(
            lambda array, rows: jnp.take(array, rows, axis=0), out_shardings=sharding
        )
    return _gathers[sharding]


def local_rows(output, sizes, process):
    """This process's rows of a step's global `output`, as a NumPy array."""
    if output is None:
        return None
    if output.is_fully_replicated:
        start = sum(sizes[:process])
        return np.asarray(output.addressable_data(0))[start : start + sizes[process]]
    shards = {}
    for shard in output.addressable_shards:
        shards.setdefault(shard.index[0].start or 0, shard)
    rows = np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])
    return rows[: sizes[process]]
