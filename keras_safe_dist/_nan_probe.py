"""In-graph non-finite checks for `SafeDistributedModel`'s train step.

`NaNOnsetDetector` asks for them; the model builds a `NaNProbe` with its train
function. Each step, every replica reduces what it can see to one health
vector: one `reduce_sum` per floating input (`x`, `y`, `sample_weight` of its
share), its micro-batch loss, one `l2_loss` per weight after the update and,
with gradient accumulation, one per local gradient (to name the micro-batch).
A non-finite entry in the vector (a NaN or an infinity in the tensor, or a sum
that overflows float32) fires the replica. The update's reduced gradient norm
is checked on the host from the step's `grad_norm` log.

The flags leave the step as one float64 log entry, which Keras MEAN-reduces
across replicas; each replica scales its entry by the number of replicas
first, so the reduced value is an exact sum:

- `nonfinite_replicas`: `fired + 2**24 * inputs`, where `fired` is the
  bitmask of the replicas that fired (sum over replicas r of `2**r`) and
  `inputs` the bitmask of those whose share of the inputs is non-finite; with
  more than 24 replicas, both are counts of replicas instead.
- `applied_updates` (for `action="continue"` only): updates applied so far
  this epoch.

No extra collective, no host round trip and no control flow: the values
travel with the logs Keras already returns. Every replica also assigns its
share of the batch to replica-local variables each step (TensorFlow shares
the batch's buffer; nothing is copied), so after the step that fired the
detector holds that batch and can replay it. What fired is worked out on the
host then, from the flags, the weights and the replay. For
`action="restore"` every step also assigns the weights and the optimizer state
to replica-local variables before the forward pass; the update then writes
new buffers, so this costs one copy of the model and its slots per step.
"""

from typing import NamedTuple

import keras
import tensorflow as tf

from keras_safe_dist import _update

__all__ = [
    "LOG_NAMES",
    "NaNProbe",
    "ProbeRequest",
    "decode",
    "inputs_nonfinite",
    "request_from",
    "tensor_nonfinite",
]

LOG_NAMES = ("nonfinite_replicas", "applied_updates")
MAX_REPLICAS_FOR_MASK = 24
_FIELD = 2**MAX_REPLICAS_FOR_MASK  # two 24-bit fields fit float64's 53-bit integers
_ON_READ = tf.VariableSynchronization.ON_READ
_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


class ProbeRequest(NamedTuple):
    """What a detector asks of the train step.

    Attributes:
        snapshot: copy the weights and optimizer state before each step.
        count_updates: log `applied_updates`.
    """

    snapshot: bool
    count_updates: bool


def request_from(callbacks):
    """The `ProbeRequest` of the first callback that makes one, or None."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in keras.tree.flatten(callbacks or []):
        request = getattr(callback, "nan_probe_request", None)
        if callable(request):
            return request()
    return None


class Step(NamedTuple):
    """One step's decoded flags."""

    fired: int  # number of replicas that fired
    replicas: tuple  # their ids, or () with more than 24 replicas
    inputs: int  # number of replicas whose share of the inputs is non-finite
    input_replicas: tuple  # their ids, or () with more than 24 replicas
    applied_updates: object  # int, or None when not requested


def decode(logs, num_replicas):
    """Decodes the probe's log entries (already reduced) into a `Step`."""
    inputs, fired = divmod(int(round(logs["nonfinite_replicas"])), _FIELD)
    replicas = input_replicas = ()
    if num_replicas <= MAX_REPLICAS_FOR_MASK:
        replicas = tuple(r for r in range(num_replicas) if fired >> r & 1)
        input_replicas = tuple(r for r in range(num_replicas) if inputs >> r & 1)
        fired, inputs = len(replicas), len(input_replicas)
    applied = logs.get("applied_updates")
    return Step(
        fired, replicas, inputs, input_replicas, None if applied is None else int(round(applied))
    )


# The checks, the same in-graph and on the host.


def inputs_nonfinite(tensors):
    """Whether a floating input holds a non-finite value (or its sum overflows float32)."""
    return _any_nonfinite(_input_terms(tensors))


def tensor_nonfinite(tensor):
    """Whether a gradient or weight holds a non-finite value (or its squared norm overflows).

    The same test as the update's reduced gradient norm.
    """
    return _any_nonfinite(_tensor_terms([tensor]))


def _input_term(tensor):
    if tensor.dtype == tf.float16:
        tensor = tf.cast(tensor, tf.float32)  # a float16 sum overflows past 65504
    return tf.cast(tf.reduce_sum(tensor), tf.float32)


def _tensor_term(tensor):
    return tf.nn.l2_loss(tensor if tensor.dtype == tf.float32 else tf.cast(tensor, tf.float32))


class NaNProbe:
    """The probe's variables and its in-graph logic.

    Args:
        model: the `SafeDistributedModel`, compiled, its optimizer built.
        request: a `ProbeRequest`.
        specs: the structure of one batch (KerasTensors with an unknown batch
            dimension), or None to capture nothing.
    """

    def __init__(self, model, request, specs):
        self.model = model
        self.request = request
        self.strategy = model.distribute_strategy
        self.replicas = self.strategy.num_replicas_in_sync
        optimizer = model.optimizer
        self.loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        # Without accumulation every step is an update, whose reduced gradient
        # norm is already checked: a local gradient check would only name the
        # replica, which the replay does. With accumulation it names the
        # micro-batch. Under loss scaling non-finite gradients are routine.
        self.check_local_gradients = model.gradient_accumulation_steps > 1 and not self.loss_scaled
        self.log_names = LOG_NAMES if request.count_updates else LOG_NAMES[:-1]
        self.names, self.structure = _capture_layout(specs)
        with self.strategy.scope():
            self.capture = None
            if self.names is not None:
                self.capture = [
                    None if s is None else _local(
                        tf.zeros([0 if d is None else d for d in s.shape], s.dtype),
                        shape=tf.TensorShape([None] + list(s.shape[1:])),
                    )
                    for s in keras.tree.flatten(self.structure)
                ]
            self.sources = []
            if request.snapshot:
                self.sources = list(model.weights) + list(optimizer.variables)
            self.snapshots = [_local(tf.zeros(v.shape, v.dtype)) for v in self.sources]

    # In-graph, replica context.

    def begin_step(self):
        """Copies weights and optimizer state (restore only), before the forward pass."""
        for snapshot, variable in zip(self.snapshots, self.sources):
            snapshot.assign(variable, read_value=False)

    def logs(self, data, loss_numerator, grads):
        """After the update: the flag as log entries; captures this replica's share."""
        flat = keras.tree.flatten(data)
        inputs = inputs_nonfinite(flat)
        terms = [tf.cast(loss_numerator, tf.float32)]
        if self.check_local_gradients:
            terms += _tensor_terms(grads)
        terms += _tensor_terms(self.model.trainable_weights)
        fired = tf.logical_or(inputs, _any_nonfinite(terms))
        if self.capture is not None:
            for variable, value in zip(self.capture, flat):
                if variable is not None:
                    variable.assign(value, read_value=False)
        bit = 1.0
        if self.replicas <= MAX_REPLICAS_FOR_MASK:
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            bit = 2.0 ** int(tf.get_static_value(replica))
        flags = tf.cast(fired, tf.float64) + _FIELD * tf.cast(inputs, tf.float64)
        logs = {"nonfinite_replicas": flags * (bit * self.replicas)}
        if "applied_updates" in self.log_names:
            stats = self.model._update_engine.stats
            logs["applied_updates"] = stats[_update._STATS.index("updates_in_epoch")]
        return logs

    # Host side.

    def captured_shares(self):
        """{local replica index: (x, y, sample_weight) as NumPy} of the last step."""
        if self.capture is None:
            return {}
        locals_ = [
            None if v is None else self.strategy.experimental_local_results(v)
            for v in self.capture
        ]
        count = len(next(v for v in locals_ if v is not None))
        return {
            index: keras.tree.pack_sequence_as(
                self.structure, [None if v is None else v[index].numpy() for v in locals_]
            )
            for index in range(count)
        }

    def named(self, share):
        """`(names, arrays)` of a captured share, in the order of `self.names`."""
        return self.names, [a for a in keras.tree.flatten(share) if a is not None]

    def restore(self):
        """Puts back the weights and optimizer state copied before the last step."""
        with self.strategy.scope():
            for snapshot, variable in zip(self.snapshots, self.sources):
                value = self.strategy.experimental_local_results(snapshot)[0]
                variable.assign(value.read_value())


def _capture_layout(specs):
    if specs is None:
        return None, None
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(specs)
    structure = (x, y, sample_weight)
    names = []
    for part, value in zip(("x", "y", "sample_weight"), structure):
        flat = [s for s in keras.tree.flatten(value) if s is not None]
        names += [part] if len(flat) == 1 else [f"{part}.{i}" for i in range(len(flat))]
        for s in flat:
            dtype = tf.as_dtype(s.dtype)
            if not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
                return None, None
    return names, structure


def _input_terms(tensors):
    values = (tf.convert_to_tensor(t) for t in tensors if t is not None)
    return [_input_term(t) for t in values if t.dtype.is_floating]


def _tensor_terms(tensors):
    values = (
        tf.convert_to_tensor(t.values if isinstance(t, tf.IndexedSlices) else t)
        for t in tensors
        if t is not None
    )
    return [_tensor_term(t) for t in values if t.dtype.is_floating]


def _any_nonfinite(terms):
    # A vector, not a sum: large finite terms must not add up to infinity.
    if not terms:
        return tf.constant(False)
    return tf.logical_not(tf.reduce_all(tf.math.is_finite(tf.stack(terms))))


def _local(initial, shape=None):
    return tf.Variable(
        initial, trainable=False, shape=shape, synchronization=_ON_READ, aggregation=_FIRST
    )
