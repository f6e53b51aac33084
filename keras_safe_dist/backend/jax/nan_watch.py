"""NaNOnsetDetector's record on JAX: the first non-finite step, decided in the step, kept on the device.

With a `NaNOnsetDetector` in `fit()`, `SafeDistributedModel`'s JAX step
updates a small record after each step (`OnsetWatch.after_step`, traced into
the compiled step):

- the number of steps run in this `fit()`, and the first step whose
  micro-batch loss or update was non-finite (its index, what was
  non-finite, its position in its accumulation group);
- with `action="continue"`, the skipped updates in a row, and the step at
  which they reached `max_consecutive_skips`;
- the last `history` steps' logged loss and gradient norm, written until
  the onset;
- with `action="restore"`, a copy of the weights and optimizer state from
  before the previous step.

After an onset with `action="stop"` or `"restore"` (or once the skips in a
row reach the limit with `"continue"`) every later step leaves the weights,
the optimizer state, the non-trainable variables and the accumulators as
they are: the host may read the record some steps late and still find the
state of the onset. With `"restore"` the onset step's own update is held
too, so the weights are those from before the onset batch.

The host reads the record without waiting on the device and without a device
operation of its own. The step also returns the record in its logs, which
Keras does not donate to the next step; the train function takes it out of
them (`log`, `take`), so Keras and the other callbacks never see it. Every
`check_every` steps, rounded up to whole executions, the detector keeps a
reference to the latest one, and reads the one it kept at the check before
(`start_read`, `finish_read`). Its step has finished by then unless the
device is that many steps behind (the read would wait for that step, not for
the latest), so the read is a small host transfer; the detector makes it in
Keras's callback thread at a batch end after the check that kept it, where it
can, so that the next check finds it done. (An asynchronous copy
started at the check before cost more host time: a check took 59
microseconds with it on a CPU, 32 without.) An onset is read at most
`steps_to_stop` steps after it. At an epoch's end the record and every
weight are read in one computation (`read_with_weights`). The batches of the
steps that can run between an onset and its read are kept (`record_batch`,
`kept_batches`), so that the onset's micro-batches can be replayed, until the
`fit()` ends (`release`): in one process, the host arrays the data gave
(`_host_batches`), else the batches Keras placed on the devices.
"""

import collections
from typing import NamedTuple

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_safe_dist.backend.jax import _compat as _jax_compat
from keras_safe_dist.update import _rule

__all__ = ["Onset", "OnsetWatch"]

# The fields of the record's `counts` vector (int32).
_FIELDS = STEPS, ONSET, KIND, CONSECUTIVE, LIMIT, POSITION = range(6)
# Bits of the KIND field.
LOSS, UPDATE = 1, 2
# The step's log that carries the record out of the step (`log`, `take`).
RECORD_LOG = "_safe_dist_nan_record"

_UPDATES = _rule.index("updates_in_epoch")
_SKIPPED = _rule.index("skipped_in_epoch")
_SKIPPED_TOTAL = _rule.index("skipped_updates")
_NORM = _rule.index("grad_norm")


class Onset(NamedTuple):
    """The record as read on the host.

    Attributes:
        steps: the steps run in this `fit()`.
        step: the onset's step (0-based, counted from the `fit()`'s first
            step), or None.
        loss: whether the onset step's micro-batch loss was non-finite.
        update: whether the onset step's update was non-finite.
        position: the onset micro-batch's position in its accumulation
            group (1 for the group's first).
        limit_step: with `action="continue"`, the step at which the skipped
            updates in a row reached the limit, or None.
        consecutive: the skipped updates in a row at the last step.
    """

    steps: int
    step: object
    loss: bool
    update: bool
    position: int
    limit_step: object
    consecutive: int

    @classmethod
    def of(cls, counts):
        counts = np.asarray(counts).tolist()
        return cls(
            steps=counts[STEPS],
            step=counts[ONSET] - 1 if counts[ONSET] else None,
            loss=bool(counts[KIND] & LOSS),
            update=bool(counts[KIND] & UPDATE),
            position=counts[POSITION],
            limit_step=counts[LIMIT] - 1 if counts[LIMIT] else None,
            consecutive=counts[CONSECUTIVE],
        )


class OnsetWatch:
    """The in-step onset record of one `SafeDistributedModel` on JAX.

    Args:
        model: the model; its optimizer is built.
        request: the detector's `ProbeRequest`.
        loss_scaled: whether a `LossScaleOptimizer` applies the updates (its
            skips are routine and do not count as an onset).
    """

    def __init__(self, model, request, loss_scaled):
        self.request = request
        self.loss_scaled = loss_scaled
        self.steps = model.gradient_accumulation_steps
        self.freezes = request.action in ("stop", "restore")
        self.counts = keras.Variable(
            np.zeros((6,), "int32"), trainable=False, dtype="int32", name="safe_dist_nan_counts"
        )
        # One row per step of the history, and a spare last row.
        self.history = keras.Variable(
            np.zeros((request.history + 1, 2), "float32"),
            trainable=False,
            name="safe_dist_nan_history",
        )
        self.snapshot = []
        sources = []
        if request.action == "restore":
            # Laid out as the variables they copy (sharded under ModelParallel).
            sources = list(model.trainable_variables) + list(model.optimizer.variables)
            self.snapshot = [
                _jax_compat.variable_like(
                    v, f"safe_dist_nan_copy_{i}", v.dtype, value=jnp.copy(v.value)
                )
                for i, v in enumerate(sources)
            ]
        self.laid_out_like = {id(c): v for c, v in zip(self.snapshot, sources)}
        self.variables = [self.counts, self.history, *self.snapshot]
        self.batches = collections.deque(maxlen=kept_batches(request.check_every, 1, self.steps))
        self.pulled = 0
        self.latest = None

    # Host side.

    def reset(self, steps_per_execution=1):
        """Starts a `fit()` on the host: no batches kept. (The update engine
        zeroes the counts on the device with its statistics, `begin_fit`.)"""
        self.batches = collections.deque(
            maxlen=kept_batches(self.request.check_every, steps_per_execution, self.steps)
        )
        self.pulled = 0
        self.latest = None

    def release(self):
        """Drops the kept batches and the latest record when a `fit()` ends, so
        that their device memory is free before the next call."""
        self.batches.clear()
        self.latest = None

    def record_batch(self, batch):
        """Keeps a reference to the batch the next step trains on (the trainer's `_Recorded`)."""
        self.batches.append((self.pulled, batch))
        self.pulled += 1

    def group(self, onset):
        """The micro-batches of the onset's accumulation group up to the onset, oldest first.

        Returns:
            `(first step, batches)`; no batches when they are no longer kept.
        """
        first = onset.step - max(onset.position, 1) + 1
        kept = {step: batch for step, batch in self.batches}
        if any(step not in kept for step in range(first, onset.step + 1)):
            return first, []
        return first, [kept[step] for step in range(first, onset.step + 1)]

    def take(self, logs):
        """Takes the record a step returned out of its logs (each step, on the host).

        The step returns the record twice: in its state, which Keras donates
        to the next step, and in its logs, which nothing donates. The
        detector reads the second, later, without a copy on the device.
        """
        self.latest = logs.pop(RECORD_LOG)

    def start_read(self):
        """The record the last step returned, for `finish_read` at the next check.

        Returns:
            A handle for `finish_read` (the record, kept by reference), or
            None before the fit's first step.
        """
        return self.latest

    @staticmethod
    def finish_read(handle):
        """The `Onset` of a handle from `start_read` (its step has finished by now).

        The record is replicated: JAX reads one device's copy.
        """
        return Onset.of(np.asarray(handle))

    def read(self):
        """The `Onset` of the record on the model (after `jax_state_sync()`); waits for the device."""
        return Onset.of(self.counts.value.addressable_data(0))

    def read_with_weights(self, model):
        """`(Onset, paths of the non-finite weights)` after `jax_state_sync()`: the
        record and a check of every floating trainable weight in one compiled
        computation and one host read (an epoch's end)."""
        weights = floating_weights(model)
        read = np.asarray(
            _counts_and_finite(self.counts.value, [v.value for v in weights]).addressable_data(0)
        )
        counts, finite = read[: len(_FIELDS)], read[len(_FIELDS) :]
        return Onset.of(counts), [v.path for v, ok in zip(weights, finite) if not ok]

    def after_flush(self, skipped, pending):
        """Records the epoch-end update of a partial group of `pending` micro-batches (on the host)."""
        counts = np.array(self.counts.value.addressable_data(0))
        if skipped:
            if not counts[ONSET] and not self.loss_scaled:
                counts[ONSET], counts[KIND], counts[POSITION] = counts[STEPS], UPDATE, pending
            counts[CONSECUTIVE] += 1
            reached = counts[CONSECUTIVE] >= self.request.max_consecutive_skips
            if self.request.action == "continue" and not counts[LIMIT] and reached:
                counts[LIMIT] = counts[STEPS]
        else:
            counts[CONSECUTIVE] = 0
        self.counts.assign(counts)

    def read_frozen(self):
        """Whether the record on the model holds the state (after an onset); waits for the device."""
        onset = self.read()
        return onset.limit_step is not None or (self.freezes and onset.step is not None)

    def history_rows(self, last, count):
        """`(step, loss, grad_norm)` of the last `count` steps up to step `last`."""
        rows = np.asarray(self.history.value.addressable_data(0))
        size = len(rows) - 1
        first = max(0, last - min(count, size) + 1)
        return [
            (step, float(rows[step % size][0]), float(rows[step % size][1]))
            for step in range(first, last + 1)
        ]

    def restore_previous(self, model):
        """Puts back the weights and optimizer state from before the step before the onset.

        Returns:
            Whether that copy held finite weights (and was put back).
        """
        sources = list(model.trainable_variables) + list(model.optimizer.variables)
        values = [v.value for v in self.snapshot]
        trainable = values[: len(model.trainable_variables)]
        if not all(
            bool(jnp.all(jnp.isfinite(value)))
            for value in trainable
            if jnp.issubdtype(value.dtype, jnp.floating)
        ):
            return False
        for variable, value in zip(sources, values):
            variable.assign(value)
        return True

    def frozen(self, counts):
        """Whether a step leaves the state as it is (a traced boolean)."""
        held = counts[LIMIT] > 0
        if self.freezes:
            held = held | (counts[ONSET] > 0)
        return held

    # Traced inside the step.

    def hold(self, values, loss):
        """Whether this step changes nothing (a traced boolean), from the record at its start.

        After an onset with `action="stop"` or `"restore"`, or once the
        skipped updates in a row reached the limit with `"continue"`. With
        `"restore"` also the onset step itself when its loss is non-finite
        (a non-finite update is held by the update engine).
        """
        counts = values[0]
        held = self.frozen(counts)
        if self.request.action == "restore":
            held = held | ((counts[ONSET] == 0) & ~jnp.isfinite(loss))
        return held

    def record(self, values, stats0, engine, loss, logged_loss, frozen):
        """The record after a step.

        Args:
            values: the record's values at the step's start.
            stats0: the update statistics at the step's start.
            engine: the update engine's values after the step
                (accumulators and totals with accumulation, statistics).
            loss: the micro-batch's loss.
            logged_loss: the loss the step logs.
            frozen: `self.frozen(counts)` at the step's start.
        """
        counts, history, *snapshot = values
        stats = engine[-1]
        step = counts[STEPS]
        open_ = (counts[ONSET] == 0) & ~frozen
        updated = (stats[_UPDATES] + stats[_SKIPPED]) > (stats0[_UPDATES] + stats0[_SKIPPED])
        loss_bad = ~jnp.isfinite(loss)
        update_bad = jnp.zeros((), bool)
        if not self.loss_scaled:
            update_bad = updated & ~jnp.isfinite(stats[_NORM])
        fired = open_ & (loss_bad | update_bad)
        kind = loss_bad.astype("int32") * LOSS + update_bad.astype("int32") * UPDATE
        position = jnp.ones((), "int32")
        if self.steps > 1:
            position = jnp.where(updated, self.steps, engine[-2][3].astype("int32"))
        fields = [
            step + 1,
            jnp.where(fired, step + 1, counts[ONSET]),
            jnp.where(fired, kind, counts[KIND]),
            counts[CONSECUTIVE],
            counts[LIMIT],
            jnp.where(fired, position, counts[POSITION]),
        ]
        if self.request.action == "continue":
            skipped = stats[_SKIPPED_TOTAL] > stats0[_SKIPPED_TOTAL]
            applied = stats[_UPDATES] > stats0[_UPDATES]
            consecutive = jnp.where(
                skipped, counts[CONSECUTIVE] + 1, jnp.where(applied, 0, counts[CONSECUTIVE])
            )
            reached = (counts[LIMIT] == 0) & (consecutive >= self.request.max_consecutive_skips)
            fields[CONSECUTIVE] = consecutive
            fields[LIMIT] = jnp.where(reached, step + 1, counts[LIMIT])
        counts = jnp.stack([f.astype("int32") for f in fields])
        # The history, written until the onset (its last row is the onset's);
        # after it each step writes the spare last row.
        size = history.shape[0] - 1
        slot = jnp.where(open_, step % size, size)
        row = jnp.stack([logged_loss.astype("float32"), stats[_NORM].astype("float32")])
        history = jax.lax.dynamic_update_slice(history, row[None, :], (slot, 0))
        return [counts, history, *snapshot]

    @staticmethod
    def log(logs, values):
        """Adds the record after a step (from `record`) to the step's logs, for `take`."""
        logs[RECORD_LOG] = values[0]

    def snapshot_after(self, values, trainable0, optimizer0, frozen, loss):
        """With `action="restore"`: the copy of the weights and optimizer state, kept
        from the start of each step until the step before an onset."""
        counts, history, *snapshot = values
        if not snapshot:
            return values
        keep = (counts[ONSET] > 0) | frozen | ~jnp.isfinite(loss)
        snapshot = [
            jnp.where(keep, old, new) for new, old in zip([*trainable0, *optimizer0], snapshot)
        ]
        return [counts, history, *snapshot]


@jax.jit
def _counts_and_finite(counts, values):
    if not values:
        return counts
    return jnp.concatenate([counts, finite_each(values).astype("int32")])


def floating_weights(model):
    """`model`'s floating trainable variables: those a NaN or an infinity can be in."""
    return [v for v in model.trainable_variables if keras.backend.is_float_dtype(v.dtype)]


def finite_each(values):
    """Whether each of `values` holds only finite numbers (traced: one computation for all)."""
    return jnp.stack([jnp.all(jnp.isfinite(value)) for value in values])


def check_interval(check_every, steps_per_execution):
    """The steps between two reads of the record: `check_every`, rounded up to
    whole executions (the detector checks when an execution begins)."""
    return steps_per_execution * -(-check_every // steps_per_execution)


def steps_to_stop(check_every, steps_per_execution):
    """The most steps that run after an onset step, the last held.

    An onset just after the step whose record a check sends to the host is
    in the next check's transfer, read at the check after that; the
    execution that begins there runs, held.
    """
    return 2 * check_interval(check_every, steps_per_execution) + steps_per_execution - 1


def kept_batches(check_every, steps_per_execution, accumulation_steps):
    """The batches kept for the replay: those of the onset's accumulation
    group up to the onset, and of every step after it up to the read (and
    one spare)."""
    return 2 * check_interval(check_every, steps_per_execution) + accumulation_steps
