"""One optimizer update per group of micro-batches, decided in cross-replica context.

Each replica adds its micro-batch gradient (of the loss numerator) into a
replica-local accumulator. After every micro-batch the replicas `merge_call`
into cross-replica context, where a `tf.cond` decides whether the group is
complete. Only there, inside `call_for_each_replica`, do the replicas all-reduce
their accumulators (once per update), divide by the group's denominator, clip
and check finiteness; a second cross-replica `tf.cond` applies or skips the
update. No synchronization point ever sits inside a conditional in replica
context, which is what makes Keras's own accumulation crash under
`MirroredStrategy`, and every replica takes the decision computed from the same
reduced values.
"""

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist.backend.tensorflow import _compat as _tf_compat
from keras_safe_dist.backend.tensorflow import _gradients
from keras_safe_dist.backend.tensorflow._accumulate import Accumulators
from keras_safe_dist.update import _loss
from keras_safe_dist.update import _rule
from keras_safe_dist.update import statistics

_ON_READ = tf.VariableSynchronization.ON_READ
_SUM = tf.VariableAggregation.SUM
_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


class TensorFlowUpdateEngine:
    """Accumulators, counters and the update logic of one SafeDistributedModel."""

    LOG_NAMES = statistics.LOG_NAMES

    def __init__(self, model, rows=True):
        self.model = model
        self.strategy = model.distribute_strategy
        self.steps = model.gradient_accumulation_steps
        self.loss_scale = _loss_scale_optimizer(model.optimizer)
        # The loss totals' dtype; the statistics are float64, which no norm
        # of a float16, float32 or float64 gradient overflows.
        self.dtype = _loss.totals_dtype(model)
        # With accumulation, whether each micro-batch objective is divided by
        # an estimate of the group's denominator, so that float16 or bfloat16
        # gradients (or loss-scaled ones) keep the magnitude of one big
        # batch's instead of overflowing (see `objective()`).
        self.estimates = self.steps > 1 and (
            self.loss_scale is not None
            or any(_gradients.is_low_precision(v.dtype) for v in model.trainable_weights)
        )
        # An overridden compute_loss() gives the whole loss, weight
        # regularization included when it calls Keras's.
        self.custom_loss = _compat.compute_loss_is_overridden(model)
        # Set while the train step is traced: whether the contributions still
        # need dividing by the reduced denominator (False without accumulation,
        # where `objective()` divides first, and for reduction="sum").
        self.normalized = True
        # Set while the step is traced (after_micro_batch).
        self.shared_rows = set()
        # Between `begin_epoch()` and `end_epoch()`.
        self.epoch_open = False
        # JAX's engine keeps a NaNOnsetDetector's record here; TensorFlow's step
        # returns the detector's flags in its logs instead.
        self.watch = None
        with self.strategy.scope():
            # The micro-batch gradients' sums, one per trainable variable;
            # Embedding tables keep their rows unless XLA compiles the step.
            self.sums = Accumulators(model, rows) if self.steps > 1 else None
            # numerator, denominator and samples of the pending group
            self.group_totals = tf.Variable(
                tf.zeros([3], self.dtype),
                trainable=False,
                synchronization=_ON_READ,
                aggregation=_SUM,
            )
            # micro-batches in the pending group, micro-batches seen this
            # epoch, micro-batches per epoch (-1: unknown)
            self.counters = self._mirrored([0, 0, -1], tf.int64)
            # see _rule.FIELDS
            self.stats = self._mirrored([0.0] * len(_rule.FIELDS), tf.float64)
        # Traced once per engine: counted apart from other models' flushes.
        self.flush_function = _tf_compat.instance_function(self._flush)

    def _mirrored(self, value, dtype):
        return tf.Variable(
            tf.constant(value, dtype), trainable=False, aggregation=_FIRST
        )

    # Host-side bookkeeping: a few eager variable writes per epoch; with
    # accumulation, one small read when a fit() begins and at an epoch's end (`flush`).

    def begin_fit(self):
        # A group pending from train_on_batch() or an interrupted fit() is
        # applied first, as an option's change applies it (one small read):
        # the fit's groups start with its first micro-batch.
        self.flush()
        self.counters.assign([0, 0, -1])
        self.stats.assign(tf.zeros([len(_rule.FIELDS)], tf.float64))

    def begin_epoch(self, steps):
        """Starts an epoch of `steps` steps (None: unknown).

        Keras runs whole executions: with `steps_per_epoch=5` and
        `steps_per_execution=3` an epoch runs 6 steps. The epoch's last
        group is applied in-graph at the last step it can run; when the data
        ends sooner, at the epoch's end (`end_epoch`).
        """
        self.epoch_open = True
        execution = self.model.steps_per_execution
        steps = -1 if steps is None else execution * -(-int(steps) // execution)
        self.counters.assign(self.counters * [1, 0, 0] + [0, 0, steps])
        self.stats.assign(self.stats * _rule.KEPT_ACROSS_EPOCHS)

    def end_epoch(self):
        """Applies the epoch's pending partial group, once per epoch.

        Returns whether one was pending.
        """
        if not self.epoch_open:
            return False
        self.epoch_open = False
        return self.flush()

    def flush(self):
        """Applies a partially filled group; returns whether one was pending."""
        if self.steps == 1:
            return False
        with self.strategy.scope():
            return bool(self.flush_function())

    def pending(self):
        """Micro-batches of the group pending (0 without accumulation): one small read."""
        if self.steps == 1:
            return 0
        with self.strategy.scope():
            return int(self.counters.read_value()[0])

    def drop_pending(self):
        """Forgets the pending group: the next micro-batch starts a new one (it overwrites the sums)."""
        if self.steps > 1:
            with self.strategy.scope():
                self.counters.assign(self.counters * [0, 1, 1])

    def _flush(self):
        pending = self.counters[0] > 0
        tf.cond(pending, self._update_from_accumulators, _nothing)
        return pending

    def logs(self):
        """The values this engine adds to each step's logs."""
        return _rule.logs(self.stats.read_value())

    def first_skip(self):
        """`(update index, samples)` of the epoch's first skipped update, or None.

        Reads the counters on the host (one small read).
        """
        return _rule.first_skip(self.stats.numpy().tolist())

    # In-graph logic.

    def objective(self, micro):
        """Replica context: the scalar to differentiate for this micro-batch.

        Without accumulation the update's denominator is known before the
        backward pass (one all-reduce of two scalars), so the loss is divided
        there and the gradients need no division after their all-reduce.
        Returns the micro-batch loss, divided in that case, the objective,
        the factor the gradients are multiplied by before they are
        accumulated (None for none), and the `(value, weight)` to log (see
        `logged_loss()`).

        With accumulation under a loss scale, or for float16 and bfloat16
        variables, the objective is the numerator divided by an estimate of
        the group's denominator (this replica's denominator x replicas x
        steps), so the low-precision gradients have the magnitude they have
        in stock Keras for one big batch instead of overflowing; the float32
        accumulated gradients are multiplied back by the estimate, which the
        division after the all-reduce then replaces with the exact
        denominator.
        """
        if micro.undivided is not None and self.steps > 1:
            raise _loss.summed_activity_penalties_error(
                self.model, "gradient_accumulation_steps", self.steps
            )
        reduced = None
        logged = micro
        if self.steps == 1 and micro.denominator is not None:
            reduced = all_reduced_totals(micro)
            numerator = tf.math.divide_no_nan(micro.numerator, reduced[1])
            if micro.undivided is not None:
                numerator += micro.undivided
            micro = micro._replace(numerator=numerator, denominator=None, undivided=None)
        objective = micro.numerator
        restore = None
        if self.estimates:
            restore = self.denominator_estimate(micro)
            objective = objective / restore
        if self.loss_scale is not None:
            objective = self.loss_scale.scale_loss(objective)
        return micro, objective, restore, self.logged_loss(logged, reduced)

    def logged_loss(self, micro, reduced=None):
        """Replica context: `(value, weight)` for Keras's loss tracker.

        Stock Keras on one device logs each batch's loss weighted by the
        batch's samples. Each replica logs the micro-batch's loss over all
        replicas' samples, weighted by its own samples, so the tracker's sums
        across replicas give exactly that. Where the denominator counts the
        samples (no mask, no `mean_with_sample_weight` weights) the replica's
        own loss, weighted by its samples, sums to the same, with no
        all-reduce; otherwise the totals are all-reduced (or taken from
        `reduced`, as `all_reduced_totals` returns them).
        """
        own = micro.per_sample and micro.denominator is not None and micro.undivided is None
        if reduced is None and self.strategy.num_replicas_in_sync > 1 and not own:
            reduced = all_reduced_totals(micro)
        return loss_value(micro, reduced), micro.samples

    def denominator_estimate(self, micro):
        """The update's denominator as this share would make it: its own x replicas x steps.

        Exact when every share of the update has the same denominator; 1 where
        the share's is 0 (an empty share or all-zero weights: its numerator
        is 0 as well), or for a loss with no denominator.
        """
        if micro.denominator is None:
            return tf.ones((), micro.numerator.dtype)
        replicas = self.strategy.num_replicas_in_sync
        estimate = micro.denominator * float(replicas * self.steps)
        return tf.where(estimate > 0, estimate, tf.ones_like(estimate))

    def after_estimated_micro_batch(self, grads, micro, estimate):
        """`after_micro_batch` for gradients of `micro.numerator / estimate`.

        What `objective()` does before the backward pass, done after it, for
        a pass that cannot hold the all-reduce (one compiled by XLA): without
        accumulation the gradients are scaled by estimate / all-reduced
        denominator, which makes them exact, and the loss divided by it; with
        accumulation under a loss scale the estimate is restored as there.
        Returns the `(value, weight)` to log, as `objective()` does.
        """
        if micro.undivided is not None:
            raise _loss.summed_activity_penalties_error(self.model, "jit_compile", True)
        restore = None
        reduced = None
        logged = micro
        if self.steps == 1 and micro.denominator is not None:
            reduced = all_reduced_totals(micro)
            total = reduced[1]
            factor = tf.math.divide_no_nan(estimate, total)
            grads = [None if g is None else _gradients.scale(g, factor) for g in grads]
            micro = micro._replace(
                numerator=tf.math.divide_no_nan(micro.numerator, total), denominator=None
            )
        elif self.estimates:
            restore = estimate
        self.after_micro_batch(grads, micro, restore)
        return self.logged_loss(logged, reduced)

    def after_micro_batch(self, grads, micro, restore=None):
        """Called in replica context once the micro-batch gradient is known.

        Args:
            grads: the gradients of the objective, one per trainable variable.
            micro: the micro-batch loss `objective()` returned.
            restore: the factor `objective()` returned, or None.
        """
        self.normalized = micro.denominator is not None
        # Sparse gradients whose rows are the same in every sample's share (an
        # Embedding over constant ids, shared by every sample): their rows are
        # summed row by row across replicas and micro-batches, as one device's
        # gradient has them once, summed over the batch.
        self.shared_rows = {
            i
            for i, g in enumerate(grads)
            if isinstance(g, tf.IndexedSlices) and _tf_compat.same_for_every_sample(g.indices)
        }
        totals = tf.stack(
            [
                micro.numerator,
                micro.denominator if self.normalized else tf.zeros((), micro.numerator.dtype),
                micro.samples,
            ]
        )
        context = tf.distribute.get_replica_context()
        if self.steps == 1:
            # Sparse gradients (an Embedding's IndexedSlices) reach the
            # all-reduce and the optimizer as they are, as in stock Keras.
            context.merge_call(self._update_now, args=(grads, totals))
            return
        # A variable with no gradient keeps none.
        pairs = [
            (acc, _gradients.restored(g, restore)) for acc, g in self.sums.pairs(grads, self.shared_rows)
        ]

        # The first micro-batch of a group overwrites the sums, so they
        # never need zeroing (a zeros constant the size of the model).
        def start():
            for acc, g in pairs:
                acc.start(g)
            self.group_totals.assign(totals)

        def add():
            for acc, g in pairs:
                acc.add(g)
            self.group_totals.assign_add(totals)

        tf.cond(tf.equal(self.counters[0], 0), start, add)
        context.merge_call(self._maybe_update, args=(totals,))

    def _update_now(self, strategy, grads, totals):
        prepared = strategy.extended.call_for_each_replica(
            self._reduce, args=(grads, totals)
        )
        self._apply_or_skip(strategy, *prepared)

    def _maybe_update(self, strategy, totals):
        # The count waits for this micro-batch's data. Keras calls the train
        # function once more on an exhausted dataset of unknown length; that
        # call fails in `get_next`, and a count that did not wait for it would
        # still run and add a micro-batch that never was.
        with tf.control_dependencies(strategy.experimental_local_results(totals)):
            counts = self.counters.assign_add([1, 1, 0])
        group, step, steps_per_epoch = tf.unstack(counts)
        complete = tf.logical_or(
            tf.greater_equal(group, self.steps), tf.equal(step, steps_per_epoch)
        )
        tf.cond(complete, self._update_from_accumulators, _nothing)

    def _update_from_accumulators(self):
        strategy = self.strategy
        prepared = strategy.extended.call_for_each_replica(self._read)
        self._apply_or_skip(strategy, *prepared)
        self.counters.assign(self.counters * [0, 1, 1])

    def _read(self):
        return self._reduce(self.sums.read(), self.group_totals.read_value())

    def _reduce(self, grads, totals):
        """Replica context: the one all-reduce, then normalization and clipping."""
        # Shared rows (see after_micro_batch) are summed as values, one row of
        # each replica onto the same row of the others; other sparse
        # gradients are gathered, every row kept, as in stock Keras.
        shared = {
            i: g for i, g in enumerate(grads)
            if i in self.shared_rows and isinstance(g, tf.IndexedSlices)
        }
        flat = [shared[i].values if i in shared else g for i, g in enumerate(grads)]
        present = [g for g in flat if g is not None]
        reduced = _gradients.all_reduce_sum(present + [totals])
        totals = reduced[-1]
        summed = iter(reduced[:-1])
        grads = [None if g is None else next(summed) for g in flat]
        for i, g in shared.items():
            grads[i] = tf.IndexedSlices(grads[i], g.indices, g.dense_shape)
        numerator, denominator, samples = tf.unstack(totals)
        divisor = None
        loss = numerator
        if self.normalized:
            divisor = denominator
            loss = tf.math.divide_no_nan(numerator, denominator)
        if self.loss_scale is not None:
            scale = tf.cast(self.loss_scale.dynamic_scale, denominator.dtype)
            divisor = scale if divisor is None else divisor * scale
        if divisor is not None:
            grads = [_gradients.divide(g, divisor) for g in grads]
        grads, loss = self._add_weight_regularization(grads, loss)
        norm = _gradients.global_norm([_gradients.summed_rows(g) for g in grads if g is not None])
        # The norm is finite only if every gradient element is (a norm that
        # overflows its float32 or float64 also counts as non-finite).
        finite = tf.logical_and(tf.math.is_finite(norm), tf.math.is_finite(loss))
        grads, clipped = self._clip(grads, norm)
        return grads, (finite, norm, clipped, samples)

    def _add_weight_regularization(self, grads, loss):
        if self.custom_loss:
            return grads, loss
        variables = self.model.trainable_weights
        with tf.GradientTape() as tape:
            penalty = _loss.weight_regularization(self.model)
        if penalty is None:
            return grads, loss
        extra = tape.gradient(penalty, variables)
        grads = [_gradients.add(g, e) for g, e in zip(grads, extra)]
        return grads, loss + penalty

    def _clip(self, grads, norm):
        model = self.model
        if model.global_clipnorm is not None:
            limit = tf.constant(model.global_clipnorm, norm.dtype)
            # As tf.clip_by_global_norm, with the norm kept in its wider dtype.
            factor = limit * tf.minimum(1.0 / norm, 1.0 / limit)
            clipped = [None if g is None else _gradients.scale(g, factor) for g in grads]
            return clipped, tf.greater(norm, limit)
        if model.clipnorm is not None:
            limit = tf.constant(model.clipnorm, norm.dtype)
            norms = [
                None if g is None else _gradients.global_norm([_gradients.summed_rows(g)]) for g in grads
            ]
            clipped = [
                None if g is None else _gradients.scale(g, limit / tf.maximum(n, limit))
                for g, n in zip(grads, norms)
            ]
            over = [tf.greater(n, limit) for n in norms if n is not None]
            return clipped, tf.reduce_any(tf.stack(over))
        if model.clipvalue is not None:
            limit = model.clipvalue
            # Rows of a sparse gradient are summed first: the clip applies to
            # the gradient's elements, not to each row's share of them.
            grads = [_gradients.unique_slices(g) for g in grads]
            clipped = [None if g is None else _gradients.clip_values(g, limit) for g in grads]
            over = [
                tf.reduce_any(tf.greater(tf.abs(_gradients.summed_rows(g)), limit))
                for g in grads
                if g is not None
            ]
            return clipped, tf.reduce_any(tf.stack(over))
        return grads, tf.constant(False)

    def _apply_or_skip(self, strategy, grads, stats):
        """Cross-replica context: every replica computed the same stats."""
        finite, norm, clipped, samples = (
            strategy.experimental_local_results(s)[0] for s in stats
        )

        def apply_update():
            optimizer = self.loss_scale.inner_optimizer if self.loss_scale else self.model.optimizer
            with _tf_compat.gradients_already_reduced(optimizer):
                strategy.extended.call_for_each_replica(
                    self._apply_gradients, args=(optimizer, grads)
                )
            if self.loss_scale is not None:
                _grow_loss_scale(self.loss_scale)
            return tf.constant(1.0, tf.float64)

        def skip_update():
            if self.loss_scale is not None:
                self.loss_scale.step_counter.assign(0)
                self.loss_scale.dynamic_scale.assign(self.loss_scale.dynamic_scale * 0.5)
            return tf.constant(0.0, tf.float64)

        if self.model.skip_nonfinite or self.loss_scale is not None:
            applied = tf.cond(finite, apply_update, skip_update)
        else:
            applied = apply_update()
        self.stats.assign(
            _rule.after_update(self.stats.read_value(), applied, norm, clipped, samples)
        )

    def _apply_gradients(self, optimizer, grads):
        variables = self.model.trainable_weights
        # Accumulated gradients are in `accumulation_dtype` (float32 for
        # float16 and bfloat16 weights by default); the update is in the weights'.
        grads = [_gradients.cast(g, v.dtype) for g, v in zip(grads, variables)]
        optimizer.apply(grads, variables)


def all_reduced_totals(micro):
    """Replica context: the numerator, denominator and undivided penalties summed over the replicas.

    One all-reduce; a part the loss does not have is summed as 0.
    """
    zero = tf.zeros((), micro.numerator.dtype)
    parts = [
        micro.numerator,
        zero if micro.denominator is None else micro.denominator,
        zero if micro.undivided is None else micro.undivided,
    ]
    context = tf.distribute.get_replica_context()
    return tf.unstack(context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack(parts)))


def loss_value(micro, reduced=None):
    """A micro-batch's loss: over all replicas' samples from `reduced`, else this replica's.

    Args:
        micro: the replica's `MicroBatchLoss`.
        reduced: None, or `all_reduced_totals(micro)`.
    """
    numerator, denominator, undivided = micro.numerator, micro.denominator, micro.undivided
    if reduced is not None:
        numerator = reduced[0]
        denominator = None if denominator is None else reduced[1]
        undivided = None if undivided is None else reduced[2]
    value = numerator if denominator is None else tf.math.divide_no_nan(numerator, denominator)
    return value if undivided is None else value + undivided


def _grow_loss_scale(optimizer):
    """Keras's dynamic loss-scale growth rule, applied after a finite update."""

    def upscale():
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)

    def increment():
        optimizer.step_counter.assign_add(1)

    tf.cond(
        tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1),
        upscale,
        increment,
    )


def _loss_scale_optimizer(optimizer):
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    return None


def _nothing():
    return None
