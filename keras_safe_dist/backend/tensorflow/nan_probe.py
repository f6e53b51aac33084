"""In-graph non-finite checks for `SafeDistributedModel`'s train step.

`NaNOnsetDetector` asks for them; the model builds a `NaNProbe` with its train
function. Each step, every replica reduces what it can see to scalar terms.
Before the forward pass, the first replica of each worker checks the trainable
weights, which the previous update produced (the reads overlap the forward
pass instead of trailing the update; a worker's replicas hold identical
copies). After it, every replica checks its share of the inputs (`x`, `y`,
`sample_weight`), its micro-batch loss and, with gradient accumulation, one
`l2_loss` per local gradient (to name the micro-batch).

The checks' arithmetic (sums first, exact only when a sum is not finite) is
`_nonfinite.py`'s.

The flags leave the step as one log entry, which Keras MEAN-reduces across
replicas; each replica scales its entry by the number of replicas first, so
the reduced value is an exact sum:

- `nonfinite_replicas`: `fired + B * inputs + B**2 * weights`. With up to 16
  replicas, `B = 2**replicas`, `fired` is the bitmask of the replicas that
  fired (sum over replicas r of `2**r`) and `inputs` the bitmask of those
  whose share of the inputs is non-finite; with more, `B` is the number of
  replicas plus one and both are counts of replicas. `weights` is the number
  of workers whose weights were non-finite when the step began. The entry is
  float32 (exact) up to 4 replicas, float64 beyond.
- `applied_updates` (for `action="continue"` only): updates applied so far
  this epoch.

No extra collective and no host round trip: the values travel with the logs
Keras already returns (the only control flow is the exact checks' `tf.cond`,
in replica context and without a collective). Every replica also assigns its
share of the batch to replica-local variables each step (TensorFlow shares
the batch's buffer; nothing is copied), so after the step that fired the
detector holds that batch and can replay it. XLA cannot change a variable's
shape, so with `jit_compile=True` the model compiles the rest of the step
with XLA on its own and, before it, assigns the batch, copies the weights
(with shared buffers) and takes the weights' terms; the compiled step waits
for them (run beside it, they competed with it for the cores), and the
weights' flag is added to the entry after it. What fired is worked out on
the host then, from the flags, the weights and the replay. For
`action="restore"` every step also assigns the weights and the optimizer state
to replica-local variables before the forward pass, keeping the previous
step's too (a weight check at a step's start speaks of the update before it);
the update then writes new buffers, so this costs one copy of the model and
its slots per step, and two copies' worth of memory.
"""

import keras
import tensorflow as tf

from keras_safe_dist.backend.tensorflow import _compat as _tf_compat
from keras_safe_dist.backend.tensorflow import _nonfinite
from keras_safe_dist.backend.tensorflow._nonfinite import entry_dtype
from keras_safe_dist.backend.tensorflow._nonfinite import inputs_nonfinite
from keras_safe_dist.backend.tensorflow._nonfinite import tensor_nonfinite
from keras_safe_dist.nan.flags import LOG_NAMES
from keras_safe_dist.nan.flags import MAX_REPLICAS
from keras_safe_dist.nan.flags import MAX_REPLICAS_FOR_MASK
from keras_safe_dist.nan.flags import base as _base
from keras_safe_dist.update import _rule

__all__ = [
    "NaNProbe",
    "WeightCheck",
    "entry_dtype",
    "inputs_nonfinite",
    "tensor_nonfinite",
]

_WEIGHT_CHECK_ATTRIBUTE = "_safe_dist_weight_check"
_ON_READ = tf.VariableSynchronization.ON_READ
_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


class NaNProbe:
    """The probe's variables and its in-graph logic.

    `SafeDistributedModel` builds one with its train function when a callback
    asks for it (`request_from`), calls `begin_step` and `logs` in each
    replica's step, and the detector reads the captured batch and restores
    the snapshots on the host. The variables are created in the model's
    strategy scope.

    Args:
        model: the `SafeDistributedModel`, compiled, its optimizer built.
        request: a `ProbeRequest`.
        specs: the structure of one batch (KerasTensors with an unknown batch
            dimension), or None to capture nothing.

    Raises:
        ValueError: when the model's strategy has more than `MAX_REPLICAS`
            (8191) replicas in sync.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    probe = NaNProbe(model, ProbeRequest(snapshot=True, count_updates=False), specs=None)
    print(probe.log_names)  # ('nonfinite_replicas',)
    ```
    """

    def __init__(self, model, request, specs):
        self.model = model
        self.request = request
        self.strategy = model.distribute_strategy
        self.replicas = self.strategy.num_replicas_in_sync
        self.dtype = _nonfinite.entry_dtype(self.replicas)
        if self.replicas > MAX_REPLICAS:
            raise ValueError(
                f"NaNOnsetDetector's in-step checks support up to {MAX_REPLICAS} replicas in "
                f"sync. Received: a strategy with {self.replicas} replicas. Train without "
                "the detector, or on fewer replicas."
            )
        optimizer = model.optimizer
        self.loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        # Without accumulation every step is an update, whose reduced gradient
        # norm is already checked: a local gradient check would only name the
        # replica, which the replay does. With accumulation it names the
        # micro-batch. Under loss scaling non-finite gradients are routine.
        self.check_local_gradients = model.gradient_accumulation_steps > 1 and not self.loss_scaled
        wanted = (True, request.count_updates, model.steps_per_execution > 1)
        self.log_names = tuple(n for n, w in zip(LOG_NAMES, wanted) if w)
        self.local_replicas = _local_replicas(self.strategy)
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
            # `current`: before this step; `previous`: before the step before it.
            self.current = [_local(tf.zeros(v.shape, v.dtype)) for v in self.sources]
            self.previous = [_local(tf.zeros(v.shape, v.dtype)) for v in self.sources]

    # In-graph, replica context.

    def begin_step(self, data):
        """Before the forward pass: captures the batch, returns the weights' terms.

        Assigns this replica's share of the batch to the capture variables
        (TensorFlow shares the batch's buffer: nothing is copied; a no-op for
        sparse, ragged or non-numeric inputs). Then takes the weights' term
        (`_finite_flag`: 0, or NaN when a weight holds a NaN or an infinity),
        reading the weights before the update. A worker's replicas hold
        identical copies of the weights, so only its first replica checks
        them. With `action="restore"`, also copies the weights and optimizer
        state.

        These small ops run one after another (control dependencies), so that
        TensorFlow's executor runs them as one task instead of dispatching each
        read and assignment to its thread pool: on a CPU that dispatch costs
        more than the ops. The weights are all read before the first sum; the
        exact check, when the sums call for it, reads the same values.
        Called outside an XLA-compiled step, which cannot change a variable's
        shape; there the copies share buffers, and the compiled step runs
        after the check.

        Args:
            data: this replica's share of the batch, `(x, y, sample_weight)`
                or what `keras.utils.unpack_x_y_sample_weight` accepts.

        Returns:
            A list holding the weights' term (a scalar tensor) on a worker's
            first replica, an empty list on its other replicas or when the
            model has no floating trainable weights.
        """
        chain = _Chain()
        if self.capture is not None:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            for variable, value in zip(self.capture, keras.tree.flatten((x, y, sample_weight))):
                if variable is not None:
                    chain.add(lambda v=variable, t=value: v.assign(t, read_value=False))
        for previous, current, variable in zip(self.previous, self.current, self.sources):
            chain.add(lambda p=previous, c=current: p.assign(c, read_value=False))
            chain.add(lambda c=current, v=variable: c.assign(v, read_value=False))
        if self._replica_id() % self.local_replicas:
            return []
        # All reads first: the update (an XLA-compiled step too) waits for the
        # reads of the variables it writes, and must not wait for the sums.
        reads = [
            chain.add(lambda v=v: tf.convert_to_tensor(v))
            for v in _floating(self.model.trainable_weights)
        ]
        if not reads:
            return []
        return [chain.add(lambda: _nonfinite.finite_flag(reads))]

    def logs(self, data, loss_numerator, grads, weight_terms):
        """After the update: the flags as log entries.

        Args:
            data: `(x, y, sample_weight)` of this replica's share.
            loss_numerator: its micro-batch loss numerator.
            grads: its local gradients.
            weight_terms: what `begin_step` returned, or () when the weights'
                flag is added after the step (`with_weight_flags`).

        Returns:
            A dict of log entries: `nonfinite_replicas`, and `applied_updates`
            when the request counts updates.
        """
        values = _nonfinite.input_values(keras.tree.flatten(data))
        inputs = [_nonfinite.finite_flag(values)] if values else []
        fired = [tf.cast(loss_numerator, tf.float32)] + inputs
        if self.check_local_gradients:
            fired += _nonfinite.tensor_terms(grads)
        groups = [fired, inputs, weight_terms]
        logs = {"nonfinite_replicas": _nonfinite.nonfinite_sum(groups, self._scales(), self.dtype)}
        if "applied_updates" in self.log_names:
            stats = self.model._update_engine.stats
            logs["applied_updates"] = stats[_rule.index("updates_in_epoch")]
        return logs

    # In-graph, cross-replica context: a multi-step execution's loop.

    count_name = LOG_NAMES[2]

    def ends_execution(self, logs):
        """Whether a step's reduced logs hold what the detector reports.

        With `steps_per_execution > 1` the execution ends after that step, so
        that the batch, the snapshots and the weights are the step's when the
        detector reads them; the logs then carry `executed_steps`. The same
        test as the detector's: a flag, a non-finite loss, or a non-finite
        gradient norm outside loss scaling.

        Args:
            logs: the step's logs, reduced across replicas.

        Returns:
            A boolean scalar tensor.
        """
        fired = tf.not_equal(logs["nonfinite_replicas"], 0)
        names = ["loss"] + ([] if self.loss_scaled else ["grad_norm"])
        for name in names:
            if name in logs:
                finite = tf.math.is_finite(tf.cast(logs[name], tf.float32))
                fired = tf.logical_or(fired, tf.logical_not(finite))
        return fired

    def with_weight_flags(self, logs, weight_terms):
        """`logs` of a step that did not check the weights, with their flag added.

        Args:
            logs: the step's logs, holding `nonfinite_replicas`.
            weight_terms: what `begin_step` returned.

        Returns:
            A new dict: `logs` with the weights' flag added to
            `nonfinite_replicas`.
        """
        logs = dict(logs)
        flag = _nonfinite.nonfinite_sum([weight_terms], self._scales()[2:], self.dtype)
        logs["nonfinite_replicas"] = logs["nonfinite_replicas"] + flag
        return logs

    def _scales(self):
        """The entry's field scales: `replicas * (bit, bit * B, B**2)`."""
        bit = 2.0 ** self._replica_id() if self.replicas <= MAX_REPLICAS_FOR_MASK else 1.0
        base = float(_base(self.replicas))
        return [self.replicas * bit, self.replicas * bit * base, self.replicas * base**2]

    def _replica_id(self):
        """This replica's id in the sync group, a Python int (static under tf.distribute)."""
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return int(tf.get_static_value(replica))

    # Host side.

    def captured_shares(self):
        """{local replica index: (x, y, sample_weight) as NumPy} of the last step.

        Returns:
            A dict, empty when the probe captures nothing (`specs=None`).
        """
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
        """`(names, arrays)` of a captured share, in the order of `self.names`.

        Args:
            share: one value of `captured_shares()`.

        Returns:
            `(self.names, arrays)`: the share's arrays, its `None` entries
            left out.
        """
        return self.names, [a for a in keras.tree.flatten(share) if a is not None]

    def restore(self, previous=False):
        """Puts back the weights and optimizer state copied before the last step.

        Args:
            previous: restore the copy from before the step before it instead.
        """
        snapshots = self.previous if previous else self.current
        with self.strategy.scope():
            for snapshot, variable in zip(snapshots, self.sources):
                value = self.strategy.experimental_local_results(snapshot)[0]
                variable.assign(value.read_value())


class WeightCheck:
    """The step's weight check as one compiled function: one host sync per call.

    Args:
        variables: the variables to check (a model's trainable weights).
    """

    def __init__(self, variables):
        self.variables = _floating(variables)
        self.function = _tf_compat.instance_function(
            lambda: _nonfinite.finite_each([tf.convert_to_tensor(v) for v in self.variables])
        )

    @classmethod
    def of(cls, model):
        """The check of `model`'s trainable weights, kept on the model.

        Tracing the check takes tens of milliseconds: kept, it is traced once
        per model (again when its trainable weights change), not once per
        `fit()` or per detector.
        """
        variables = _floating(model.trainable_weights)
        check = model.__dict__.get(_WEIGHT_CHECK_ATTRIBUTE)
        if check is None or [id(v) for v in check.variables] != [id(v) for v in variables]:
            check = cls(variables)
            # Stored past Keras's attribute tracking: not part of the model's state.
            model.__dict__[_WEIGHT_CHECK_ATTRIBUTE] = check
        return check

    def __call__(self):
        """Paths of the variables holding a non-finite value, in order."""
        if not self.variables:
            return []
        finite = self.function().numpy()
        return [v.path for v, ok in zip(self.variables, finite) if not ok]


def _floating(variables):
    return [v for v in variables if tf.as_dtype(v.dtype).is_floating]


class _Chain:
    """Builds ops that run one after another, each after the previous one."""

    def __init__(self):
        self.last = None

    def add(self, build):
        """Builds `build()` after the last op added; returns what it returned."""
        with tf.control_dependencies([] if self.last is None else [self.last]):
            self.last = build()
        return self.last


def _local_replicas(strategy):
    """Replicas on this worker."""
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: one replica
        return 1


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
            numeric = dtype.is_floating or dtype.is_integer or dtype.is_bool
            if not numeric or s.sparse or s.ragged:
                return None, None
    return names, structure


def _local(initial, shape=None):
    return tf.Variable(
        initial, trainable=False, shape=shape, synchronization=_ON_READ, aggregation=_FIRST
    )
