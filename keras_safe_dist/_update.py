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
from keras_safe_dist import _loss

_ON_READ = tf.VariableSynchronization.ON_READ
_SUM = tf.VariableAggregation.SUM
_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


class UpdateEngine:
    """Accumulators, counters and the update logic of one SafeDistributedModel."""

    LOG_NAMES = ("grad_norm", "clip_rate", "skipped_updates", "samples_per_update")

    def __init__(self, model):
        self.model = model
        self.strategy = model.distribute_strategy
        self.steps = model.gradient_accumulation_steps
        self.loss_scale = _loss_scale_optimizer(model.optimizer)
        # An overridden compute_loss() gives the whole loss, weight
        # regularization included when it calls Keras's.
        self.custom_loss = _compat.compute_loss_is_overridden(model)
        # Set while the train step is traced: whether the contributions still
        # need dividing by the reduced denominator (False without accumulation,
        # where `objective()` divides first, and for reduction="sum").
        self.normalized = True
        # Set while the train step is traced: indexes of the trainable
        # variables the loss gives no gradient (None, as Keras passes it).
        self.no_gradient = set()
        # Between `begin_epoch()` and `end_epoch()`.
        self.epoch_open = False
        with self.strategy.scope():
            self.accumulators = [
                tf.Variable(
                    tf.zeros(v.shape, dtype=v.dtype),
                    trainable=False,
                    synchronization=_ON_READ,
                    aggregation=_SUM,
                    name="safe_dist_accumulator",
                )
                for v in (model.trainable_weights if self.steps > 1 else [])
            ]
            # numerator, denominator and samples of the pending group
            self.group_totals = tf.Variable(
                tf.zeros([3]),
                trainable=False,
                synchronization=_ON_READ,
                aggregation=_SUM,
            )
            # micro-batches in the pending group, micro-batches seen this
            # epoch, micro-batches per epoch (-1: unknown)
            self.counters = self._mirrored([0, 0, -1], tf.int64)
            # see _STATS
            self.stats = self._mirrored([0.0] * len(_STATS), tf.float32)
        self.flush_function = tf.function(self._flush)

    def _mirrored(self, value, dtype):
        return tf.Variable(
            tf.constant(value, dtype), trainable=False, aggregation=_FIRST
        )

    # Host-side bookkeeping: a few eager variable writes per epoch, no reads.

    def begin_fit(self):
        self.counters.assign([0, 0, -1])
        self.stats.assign(tf.zeros([len(_STATS)]))

    def begin_epoch(self, steps):
        self.epoch_open = True
        steps = -1 if steps is None else int(steps)
        self.counters.assign(self.counters * [1, 0, 0] + [0, 0, steps])
        self.stats.assign(self.stats * _KEPT_ACROSS_EPOCHS)

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

    def _flush(self):
        pending = self.counters[0] > 0
        tf.cond(pending, self._update_from_accumulators, _nothing)
        return pending

    def logs(self):
        """The values this engine adds to each step's logs."""
        stats = self.stats.read_value()
        return {
            "grad_norm": stats[_STATS.index("grad_norm")],
            "clip_rate": tf.math.divide_no_nan(
                stats[_STATS.index("clipped_in_epoch")],
                stats[_STATS.index("updates_in_epoch")],
            ),
            "skipped_updates": stats[_STATS.index("skipped_updates")],
            "samples_per_update": stats[_STATS.index("samples_per_update")],
        }

    def first_skip(self):
        """`(update index, samples)` of the epoch's first skipped update, or None.

        Reads the counters on the host (one small read).
        """
        stats = dict(zip(_STATS, self.stats.numpy().tolist()))
        if stats["skipped_in_epoch"] == 0:
            return None
        return int(stats["first_skip"]) - 1, int(stats["first_skip_samples"])

    # In-graph logic.

    def objective(self, micro):
        """Replica context: the scalar to differentiate for this micro-batch.

        Without accumulation the update's denominator is known before the
        backward pass (one scalar all-reduce), so the loss is divided there
        and the gradients need no division after their all-reduce. Returns
        the micro-batch loss, divided in that case, the objective, and the
        factor the gradients are multiplied by before they are accumulated
        (None for none).

        With accumulation under a loss scale, the objective is the scaled
        numerator divided by an estimate of the group's denominator (this
        replica's denominator x replicas x steps), so the float16 gradients
        have the magnitude they have in stock Keras for one big batch instead
        of overflowing; the float32 gradients are multiplied back by the
        estimate, which the division after the all-reduce then replaces with
        the exact denominator.
        """
        if micro.undivided is not None and self.steps > 1:
            raise _summed_activity_penalties_error(self.model, "gradient_accumulation_steps", self.steps)
        if self.steps == 1 and micro.denominator is not None:
            context = tf.distribute.get_replica_context()
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, micro.denominator)
            numerator = tf.math.divide_no_nan(micro.numerator, total)
            if micro.undivided is not None:
                numerator += micro.undivided
            micro = micro._replace(numerator=numerator, denominator=None, undivided=None)
        objective = micro.numerator
        restore = None
        if self.loss_scale is not None:
            if self.steps > 1:
                restore = self.denominator_estimate(micro)
                objective = objective / restore
            objective = self.loss_scale.scale_loss(objective)
        return micro, objective, restore

    def denominator_estimate(self, micro):
        """The update's denominator as this share would make it: its own x replicas x steps.

        Exact when every share of the update has the same denominator; 1 where
        the share's is 0 (an empty share or all-zero weights: its numerator
        is 0 as well), or for a loss with no denominator.
        """
        if micro.denominator is None:
            return tf.ones(())
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
        """
        if micro.undivided is not None:
            raise _summed_activity_penalties_error(self.model, "jit_compile", True)
        restore = None
        if self.steps == 1 and micro.denominator is not None:
            context = tf.distribute.get_replica_context()
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, micro.denominator)
            factor = tf.math.divide_no_nan(estimate, total)
            grads = [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]
            micro = micro._replace(
                numerator=tf.math.divide_no_nan(micro.numerator, total), denominator=None
            )
        elif self.loss_scale is not None:
            restore = estimate
        self.after_micro_batch(grads, micro, restore)

    def after_micro_batch(self, grads, micro, restore=None):
        """Called in replica context once the micro-batch gradient is known.

        Args:
            grads: the gradients of the objective, one per trainable variable.
            micro: the micro-batch loss `objective()` returned.
            restore: the factor `objective()` returned, or None.
        """
        self.normalized = micro.denominator is not None
        totals = tf.stack(
            [
                micro.numerator,
                micro.denominator if self.normalized else tf.zeros(()),
                micro.samples,
            ]
        )
        context = tf.distribute.get_replica_context()
        if self.steps == 1:
            # Sparse gradients (an Embedding's IndexedSlices) reach the
            # all-reduce and the optimizer as they are, as in stock Keras.
            context.merge_call(self._update_now, args=(grads, totals))
            return
        # Accumulators are dense: a variable with no gradient keeps none.
        self.no_gradient = {i for i, g in enumerate(grads) if g is None}
        pairs = [
            (acc, _restored(tf.convert_to_tensor(g), restore))
            for acc, g in zip(self.accumulators, grads)
            if g is not None
        ]

        # The first micro-batch of a group overwrites the accumulators, so
        # they never need zeroing (a zeros constant the size of the model).
        def start():
            for acc, g in pairs:
                acc.assign(g)
            self.group_totals.assign(totals)

        def add():
            for acc, g in pairs:
                acc.assign_add(g)
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
        grads = [
            None if i in self.no_gradient else acc.read_value()
            for i, acc in enumerate(self.accumulators)
        ]
        return self._reduce(grads, self.group_totals.read_value())

    def _reduce(self, grads, totals):
        """Replica context: the one all-reduce, then normalization and clipping."""
        context = tf.distribute.get_replica_context()
        present = [g for g in grads if g is not None]
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, present + [totals])
        totals = reduced[-1]
        summed = iter(reduced[:-1])
        grads = [None if g is None else next(summed) for g in grads]
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
            grads = [_divide(g, divisor) for g in grads]
        grads, loss = self._add_weight_regularization(grads, loss)
        norm = tf.linalg.global_norm([_summed_rows(g) for g in grads])
        # The norm is finite only if every gradient element is (a norm that
        # overflows float32 also counts as non-finite).
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
        grads = [_add(g, e) for g, e in zip(grads, extra)]
        return grads, loss + penalty

    def _clip(self, grads, norm):
        model = self.model
        if model.global_clipnorm is not None:
            limit = tf.constant(model.global_clipnorm, norm.dtype)
            clipped, _ = tf.clip_by_global_norm(grads, limit, use_norm=norm)
            return clipped, tf.greater(norm, limit)
        if model.clipnorm is not None:
            limit = tf.constant(model.clipnorm, norm.dtype)
            norms = [None if g is None else tf.norm(_summed_rows(g)) for g in grads]
            clipped = [
                None if g is None else _scale(g, limit / tf.maximum(n, limit))
                for g, n in zip(grads, norms)
            ]
            over = [tf.greater(n, limit) for n in norms if n is not None]
            return clipped, tf.reduce_any(tf.stack(over))
        if model.clipvalue is not None:
            limit = model.clipvalue
            # Rows of a sparse gradient are summed first: the clip applies to
            # the gradient's elements, not to each row's share of them.
            grads = [_unique_slices(g) for g in grads]
            clipped = [None if g is None else _clip_values(g, limit) for g in grads]
            over = [
                tf.reduce_any(tf.greater(tf.abs(_summed_rows(g)), limit))
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
            with _compat.gradients_already_reduced(optimizer):
                strategy.extended.call_for_each_replica(
                    self._apply_gradients, args=(optimizer, grads)
                )
            if self.loss_scale is not None:
                _grow_loss_scale(self.loss_scale)
            return tf.constant(1.0)

        def skip_update():
            if self.loss_scale is not None:
                self.loss_scale.step_counter.assign(0)
                self.loss_scale.dynamic_scale.assign(self.loss_scale.dynamic_scale * 0.5)
            return tf.constant(0.0)

        if self.model.skip_nonfinite or self.loss_scale is not None:
            applied = tf.cond(finite, apply_update, skip_update)
        else:
            applied = apply_update()
        old = tf.unstack(self.stats.read_value())
        new = dict(zip(_STATS, old))
        skipped = 1.0 - applied
        # The first skip of the epoch: its index among the epoch's updates
        # (stored + 1, so that 0 means none) and its samples.
        first = skipped * tf.cast(tf.equal(new["skipped_in_epoch"], 0.0), tf.float32)
        new.update(
            grad_norm=norm,
            samples_per_update=samples,
            updates_in_epoch=new["updates_in_epoch"] + applied,
            clipped_in_epoch=new["clipped_in_epoch"] + applied * tf.cast(clipped, tf.float32),
            skipped_updates=new["skipped_updates"] + skipped,
            skipped_in_epoch=new["skipped_in_epoch"] + skipped,
            first_skip=new["first_skip"]
            + first * (new["updates_in_epoch"] + new["skipped_in_epoch"] + 1.0),
            first_skip_samples=new["first_skip_samples"] + first * samples,
        )
        self.stats.assign(tf.stack([new[name] for name in _STATS]))

    def _apply_gradients(self, optimizer, grads):
        optimizer.apply(list(grads), self.model.trainable_weights)


_STATS = (
    "grad_norm",
    "samples_per_update",
    "updates_in_epoch",
    "clipped_in_epoch",
    "skipped_updates",
    "skipped_in_epoch",
    "first_skip",
    "first_skip_samples",
)
_KEPT_ACROSS_EPOCHS = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def _summed_activity_penalties_error(model, option, value):
    layers = [
        layer.name
        for layer in _compat.flatten_layers(model)
        if getattr(layer, "activity_regularizer", None) is not None
    ]
    return ValueError(
        "SafeDistributedModel cannot train activity regularizers exactly with "
        f"{option}={value!r} on keras {keras.__version__}: before keras 3.14 "
        "Keras adds an activity penalty summed over the batch, not divided by "
        "it, and that sum cannot be split into micro-batches or compiled "
        "shares whose loss is divided once after the all-reduce. Received: "
        f"{option}={value!r} and activity regularizers on layers {layers}. "
        f"Use keras >= 3.14, or {option}="
        f"{1 if option == 'gradient_accumulation_steps' else False}."
    )


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


def _restored(grad, factor):
    return grad if factor is None else grad * tf.cast(factor, grad.dtype)


def _unique_slices(grad):
    """A sparse gradient with each row once (repeated rows summed)."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    rows, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, grad.dense_shape)


def _summed_rows(grad):
    """The values whose norm is the gradient's norm (None stays None)."""
    if isinstance(grad, tf.IndexedSlices):
        return _unique_slices(grad).values
    return grad


def _scale(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        factor = tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def _divide(grad, divisor):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        values = tf.math.divide_no_nan(grad.values, tf.cast(divisor, grad.values.dtype))
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return tf.math.divide_no_nan(grad, tf.cast(divisor, grad.dtype))


def _clip_values(grad, limit):
    if isinstance(grad, tf.IndexedSlices):
        values = tf.clip_by_value(grad.values, -limit, limit)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return tf.clip_by_value(grad, -limit, limit)


def _add(grad, extra):
    """`grad + extra`, either of which may be None; a sum with a dense term is dense."""
    if extra is None:
        return grad
    extra = tf.convert_to_tensor(extra)
    if grad is None:
        return extra
    return tf.convert_to_tensor(grad) + extra


def _nothing():
    return None
