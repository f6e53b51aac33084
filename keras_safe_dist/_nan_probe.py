"""In-graph non-finite checks for `SafeDistributedModel`'s train step.

`NaNOnsetDetector` asks for them; the model builds a `NaNProbe` with its train
function. Each step, every replica checks its own share of the inputs and its
micro-batch loss (and, with gradient accumulation, its local gradients, to
name the micro-batch), and every replica checks the weights after the update
(the same on all replicas); the update's reduced gradient norm is already
checked by the engine. The flags leave the step as scalar log entries, which
Keras MEAN-reduces across replicas; per-replica entries are scaled by the
number of replicas first, so the reduced value is an exact sum:

- `nonfinite_replicas`: sum over replicas r of `2**r` if replica r saw a
  non-finite input, loss or gradient (a bitmask; with more than 24 replicas,
  the number of such replicas).
- `nonfinite_kinds`: sum over replicas of `inputs + 256 * loss + 65536 *
  gradients` (how many replicas saw each kind).
- `nonfinite_weights`: 1 when a weight is non-finite after the update.
- `applied_updates` (for `action="continue"` only): updates applied so far
  this epoch.

No extra collective and no host round trip: the values travel with the logs
Keras already returns. On the first step a replica fires, a `tf.cond` with no
synchronization inside copies that replica's share of the batch into
replica-local variables, so the detector can replay it. For `action="restore"`
every step also copies the weights and the optimizer state into replica-local
variables before the forward pass (one copy of the model and its slots).
"""

from typing import NamedTuple

import keras
import tensorflow as tf

from keras_safe_dist import _update

__all__ = ["LOG_NAMES", "NaNProbe", "ProbeRequest", "decode", "request_from"]

LOG_NAMES = ("nonfinite_replicas", "nonfinite_kinds", "nonfinite_weights", "applied_updates")
LOCAL_KINDS = ("inputs", "loss", "gradients")
_KIND_BASE = 256
MAX_REPLICAS = _KIND_BASE - 1
MAX_REPLICAS_FOR_MASK = 24  # 2**24: the largest float32 integer range
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

    replicas: tuple  # replica ids, or () when unknown or none
    kinds: dict  # local kind -> number of replicas
    weights: bool
    applied_updates: object  # int, or None when not requested

    @property
    def local(self):
        return any(self.kinds.values())


def decode(logs, num_replicas):
    """Decodes the probe's log entries (already reduced) into a `Step`."""
    mask = int(round(logs["nonfinite_replicas"]))
    code = int(round(logs["nonfinite_kinds"]))
    kinds = {}
    for kind in LOCAL_KINDS:
        code, kinds[kind] = divmod(code, _KIND_BASE)
    replicas = ()
    if num_replicas <= MAX_REPLICAS_FOR_MASK:
        replicas = tuple(r for r in range(num_replicas) if mask >> r & 1)
    applied = logs.get("applied_updates")
    return Step(
        replicas,
        kinds,
        logs["nonfinite_weights"] > 0.5,
        None if applied is None else int(round(applied)),
    )


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
        if self.replicas > MAX_REPLICAS:
            raise ValueError(
                f"NaNOnsetDetector supports at most {MAX_REPLICAS} replicas in "
                f"sync. Received: {self.replicas} replicas. Train without the "
                "detector, or on fewer replicas."
            )
        optimizer = model.optimizer
        self.loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        # Without accumulation every step is an update, whose reduced gradient
        # norm is already checked: a local gradient check would only name the
        # replica, which the replay does. With accumulation it names the
        # micro-batch.
        self.check_local_gradients = model.gradient_accumulation_steps > 1 and not self.loss_scaled
        self.log_names = LOG_NAMES if request.count_updates else LOG_NAMES[:-1]
        self.names, self.structure = _capture_layout(specs)
        with self.strategy.scope():
            self.captured = _local(tf.zeros((), tf.int32))
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
            snapshot.assign(variable)

    def logs(self, data, loss_numerator, grad_norm, grads):
        """After the update: the flags as log entries; captures on the first fire.

        Inputs and loss are checked element by element. Gradients and weights
        go through one `l2_loss` per tensor: like the update's own gradient
        norm, a tensor whose squared norm overflows float32 counts as
        non-finite. This keeps the check to about one op per tensor.
        """
        flat = keras.tree.flatten(data)
        inputs = _nonfinite([t for t in flat if t is not None])
        loss = tf.logical_not(tf.math.is_finite(loss_numerator))
        gradients = reduced = tf.constant(False)
        # Under loss scaling, non-finite gradients are routine: the update is
        # skipped and the scale halves.
        if not self.loss_scaled:
            reduced = tf.logical_not(tf.math.is_finite(grad_norm))
        if self.check_local_gradients:
            gradients = _overflows([g.values if isinstance(g, tf.IndexedSlices) else g
                                    for g in grads if g is not None])
        weights = _overflows(self.model.trainable_weights)
        local = tf.stack([inputs, loss, gradients])
        fired = tf.reduce_any(local)
        self._maybe_capture(flat, fired | weights | reduced)
        scale = float(self.replicas)
        bit = 1.0
        if self.replicas <= MAX_REPLICAS_FOR_MASK:
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            bit = 2.0 ** int(tf.get_static_value(replica))
        logs = {
            "nonfinite_replicas": tf.cast(fired, tf.float32) * (bit * scale),
            "nonfinite_kinds": tf.reduce_sum(
                tf.cast(local, tf.float32) * [scale, _KIND_BASE * scale, _KIND_BASE**2 * scale]
            ),
            "nonfinite_weights": tf.cast(weights, tf.float32),
        }
        if "applied_updates" in self.log_names:
            stats = self.model._update_engine.stats
            logs["applied_updates"] = stats[_update._STATS.index("updates_in_epoch")]
        return logs

    def _maybe_capture(self, flat, fired):
        if self.capture is None:
            return

        def capture():
            for variable, value in zip(self.capture, flat):
                if variable is not None:
                    variable.assign(value)
            self.captured.assign(1)

        tf.cond(fired & tf.equal(self.captured, 0), capture, lambda: None)

    # Host side.

    def reset(self):
        """Forgets a captured batch; called when a fit begins."""
        for local in self.strategy.experimental_local_results(self.captured):
            local.assign(0)

    def captured_shares(self):
        """{local replica index: (x, y, sample_weight) as NumPy} for captured shares."""
        if self.capture is None:
            return {}
        flags = [int(v.numpy()) for v in self.strategy.experimental_local_results(self.captured)]
        shares = {}
        for index, flag in enumerate(flags):
            if flag:
                arrays = [
                    None if v is None else
                    self.strategy.experimental_local_results(v)[index].numpy()
                    for v in self.capture
                ]
                shares[index] = keras.tree.pack_sequence_as(self.structure, arrays)
        return shares

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


def _local(initial, shape=None):
    return tf.Variable(
        initial, trainable=False, shape=shape, synchronization=_ON_READ, aggregation=_FIRST
    )


def _overflows(tensors):
    squares = [
        tf.nn.l2_loss(t if t.dtype == tf.float32 else tf.cast(t, tf.float32))
        for t in (tf.convert_to_tensor(t) for t in tensors)
        if t.dtype.is_floating
    ]
    if not squares:
        return tf.constant(False)
    return tf.logical_not(tf.math.is_finite(tf.add_n(squares)))


def _nonfinite(tensors):
    checks = [
        tf.reduce_all(tf.math.is_finite(t))
        for t in (tf.convert_to_tensor(t) for t in tensors)
        if t.dtype.is_floating
    ]
    if not checks:
        return tf.constant(False)
    return tf.logical_not(tf.reduce_all(tf.stack(checks)))
