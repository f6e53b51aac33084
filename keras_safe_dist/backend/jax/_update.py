"""JAX's update for `SafeDistributedModel`: accumulate, divide, clip, skip, apply.

`JAXUpdateEngine` holds the pending group's gradient sums and totals in
`keras.Variable`s that Keras threads through its jitted step (the trainer lists
them after the metrics' variables). Each micro-batch adds its gradient of the
loss numerator; the last of a group divides the sum by the group's exact
denominator, adds the weight regularization gradient once, clips, and applies
it, or leaves weights and optimizer state as they were when the update is not
finite. The rule it follows is `_loss`'s and `_stats`'s, shared with
TensorFlow's `TensorFlowUpdateEngine`; the trainer is `trainer.py`, beside this module.
"""


import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import ops

from keras_safe_dist import _compat
from keras_safe_dist.backend.jax import _compat as _jax_compat
from keras_safe_dist.backend.jax import _gradients
from keras_safe_dist.backend.jax.nan_watch import OnsetWatch
from keras_safe_dist.update import _loss
from keras_safe_dist.update import _rule
from keras_safe_dist.update import statistics

__all__ = ["JAXUpdateEngine"]

# numerator, denominator, samples and micro-batches of the pending group
_TOTALS = 4


class JAXUpdateEngine:
    """Accumulators, counters and the update logic of one SafeDistributedModel on JAX.

    Its methods that take values are pure functions of them, traced inside
    Keras's jitted step; the host-side ones (`begin_fit`, `begin_epoch`,
    `end_epoch`, `flush`, `first_skip`) read or write the variables between
    steps, a few times per epoch.
    """

    LOG_NAMES = statistics.LOG_NAMES

    def __init__(self, model, nan_request=None):
        self.model = model
        self.nan_request = nan_request
        self.steps = model.gradient_accumulation_steps
        self.options = dict(model.__dict__["_safe_dist_options"])
        self.loss_scale = _loss_scale_optimizer(model.optimizer)
        self.dtype = _loss.totals_dtype(model)
        # An overridden compute_loss() gives the whole loss, weight
        # regularization included when it calls Keras's.
        self.custom_loss = _compat.compute_loss_is_overridden(model)
        self.epoch_open = False
        # Set by `begin_fit`, whose zeroed statistics need no epoch reset.
        self.statistics_zeroed = False
        trainable = model.trainable_variables
        # What the step is built for (`check_trainable`).
        self.trainable = list(trainable)
        self.sums = []
        # The dtype each gradient is summed in (`accumulation_dtype`), or
        # widened to without accumulation.
        chosen = self.options["accumulation_dtype"] if self.steps > 1 else None
        self.sum_dtypes = [_loss.accumulator_dtype(v.dtype, chosen) for v in trainable]
        if self.steps > 1:
            # Laid out as their variables are (sharded under ModelParallel):
            # one sharded copy of the gradient, never a full one per device.
            self.sums = [
                _jax_compat.variable_like(v, f"safe_dist_sum_{i}", dtype)
                for i, (v, dtype) in enumerate(zip(trainable, self.sum_dtypes))
            ]
        # Each per-variable state of ours -> the variable it is laid out like.
        self.laid_out_like = {id(s): v for s, v in zip(self.sums, trainable)}
        # The pending group's totals: none without accumulation (one fewer
        # array through each step).
        self.totals = None
        if self.steps > 1:
            self.totals = keras.Variable(
                ops.zeros((_TOTALS,), self.dtype), trainable=False, name="safe_dist_totals"
            )
        self.stats = keras.Variable(
            ops.zeros((len(_rule.FIELDS),), "float32"), trainable=False, name="safe_dist_stats"
        )
        self.variables = [*self.sums, *([] if self.totals is None else [self.totals]), self.stats]
        # A NaNOnsetDetector's in-step record (see `nan_watch`), threaded
        # through the step after the engine's own variables.
        self.watch = None
        if nan_request is not None:
            self.watch = OnsetWatch(model, nan_request, self.loss_scale is not None)
        self.state_variables = self.variables + (self.watch.variables if self.watch else [])
        if self.watch is not None:
            self.laid_out_like.update(self.watch.laid_out_like)
        self._flush_function = jax.jit(self._flush_values, static_argnums=3)
        self.sharded_weights = False  # see `read_layout`
        self.norm_by_concatenation = False  # see `read_layout`

    def check_trainable(self):
        """Raises a `ValueError` when the model's trainable variables are no
        longer those this engine and Keras's optimizer were built for.

        A layer's `trainable` set after training began, without `compile()`
        since: Keras's JAX backend then fails inside the step ("must be a list
        of tensors corresponding 1:1 to the trainable variables list that the
        optimizer was built with"), and with accumulation the sums would not
        match the gradients. One walk of the trainable variables per call
        (stock walks them to build each epoch's state).
        """
        current = self.model.trainable_variables
        if len(current) == len(self.trainable) and all(
            now is then for now, then in zip(current, self.trainable)
        ):
            return
        before = {id(v) for v in self.trainable}
        now = {id(v) for v in current}
        added = [v.path for v in current if id(v) not in before]
        removed = [v.path for v in self.trainable if id(v) not in now]
        changes = "; ".join(
            f"{what}: {', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''}"
            for what, paths in (("now trainable", added), ("no longer trainable", removed))
            if paths
        )
        raise ValueError(
            "SafeDistributedModel's trainable variables changed since it was compiled "
            f"for training on JAX ({len(self.trainable)} then, {len(current)} now; "
            f"{changes or 'the same variables in another order'}). Keras's optimizer "
            "and the gradient accumulators are built for the trainable variables "
            "of the first fit() after compile(). Call model.compile(...) again after "
            "setting a layer's `trainable`, as Keras's JAX backend requires."
        )

    def read_layout(self):
        """Notes where the weights are, before each compile.

        The step's skip depends on whether a distribution shards them
        (ModelParallel), and how it sums the gradients' squares on which
        platform they are (see `_update` and `_gradients.global_norm`).
        """
        values = [v.value for v in self.model.trainable_variables]
        self.sharded_weights = any(_gradients.is_sharded(value) for value in values)
        self.norm_by_concatenation = _gradients.joins_norm(values)

    def stale(self, nan_request=None):
        """Whether the model's options, optimizer or NaN detector changed since this
        engine was built (its trainable variables cannot have: `check_trainable`)."""
        model = self.model
        return (
            self.nan_request != nan_request
            or self.options != model.__dict__["_safe_dist_options"]
            or self.loss_scale is not _loss_scale_optimizer(model.optimizer)
        )

    # Host side.

    def begin_fit(self):
        """Applies a group pending from `train_on_batch()` or an interrupted `fit()`
        (as an option's change does; one small read), so that the fit's groups start
        with its first micro-batch. Then zeroes the statistics, and a
        NaNOnsetDetector's counts: one compiled call."""
        self.flush()
        variables = [self.stats] + ([self.watch.counts] if self.watch else [])
        for variable, value in zip(variables, _RESET_FIT([v.value for v in variables])):
            variable.assign(value)
        # The first epoch's reset would keep them zero: one compiled call less a fit.
        self.statistics_zeroed = True

    def begin_epoch(self, steps):
        self.epoch_open = True
        if self.statistics_zeroed:
            self.statistics_zeroed = False
            return
        # One compiled call: Keras's eager ops cost tens of microseconds each.
        self.stats.assign(_RESET_EPOCH(self.stats.value))

    def end_epoch(self):
        """Applies the epoch's pending partial group, once per epoch; returns whether one was."""
        if not self.epoch_open:
            return False
        self.epoch_open = False
        return self.flush()

    def flush(self):
        """Applies a partially filled group; returns whether one was pending."""
        if self.steps == 1 or float(self.totals.value[3]) == 0:
            return False
        if self.watch is not None and self.watch.read_frozen():
            # A NaNOnsetDetector's onset holds the state: the pending group
            # is dropped, as the steps after the onset were.
            self.totals.assign(ops.zeros_like(self.totals.value))
            return False
        model = self.model
        pending = int(self.totals.value[3])
        skipped_before = float(self.stats.value[_rule.index("skipped_updates")])
        trainable = [v.value for v in model.trainable_variables]
        optimizer_values = [v.value for v in model.optimizer.variables]
        values = [v.value for v in self.variables]
        # The step's shape depends on whether the norm is read; the flag
        # keys the compiled flush so that a change retraces it.
        trainable, optimizer_values, values = self._flush_function(
            trainable, optimizer_values, values, self._reads_norm()
        )
        for variable, value in zip(model.trainable_variables, trainable):
            variable.assign(value)
        for variable, value in zip(model.optimizer.variables, optimizer_values):
            variable.assign(value)
        for variable, value in zip(self.variables, values):
            variable.assign(value)
        if self.watch is not None:
            skipped = float(self.stats.value[_rule.index("skipped_updates")]) > skipped_before
            self.watch.after_flush(skipped, pending)
        return True

    def pending(self):
        """Micro-batches of the group pending (0 without accumulation): one small read."""
        return 0 if self.steps == 1 else int(self.totals.value[3])

    def drop_pending(self):
        """Forgets the pending group: the next micro-batch starts a new one (it overwrites the sums)."""
        if self.steps > 1:
            self.totals.assign(ops.zeros_like(self.totals.value))

    def logs(self, values=None):
        """The values this engine adds to the logs (from `values`, or the variables)."""
        stats = values[-1] if values is not None else self.stats.value
        return _rule.logs(stats)

    def updates_in_epoch(self):
        """The updates applied in this epoch so far (one host read)."""
        return int(np.asarray(self.stats.value)[_rule.index("updates_in_epoch")])

    def first_skip(self):
        """`(update index, samples)` of the epoch's first skipped update, or None."""
        return _rule.first_skip(np.asarray(self.stats.value).tolist())  # one read

    # Traced inside the step.

    def objective(self, micro):
        """`(objective, (value, weight) to log)` for one micro-batch.

        Without accumulation the objective is the micro-batch's loss, as
        stock Keras differentiates it. With accumulation it is the numerator
        divided by an estimate of the group's denominator (this micro-batch's
        times the group's size), so that float16 and loss-scaled gradients
        keep the magnitude of one big batch's; `after_micro_batch` multiplies
        the accumulated gradient back by the estimate and divides the sum by
        the group's exact denominator.
        """
        if micro.undivided is not None and self.steps > 1:
            raise _loss.summed_activity_penalties_error(
                self.model, "gradient_accumulation_steps", self.steps
            )
        value = micro.numerator
        if micro.denominator is not None:
            value = _gradients.divide_no_nan(micro.numerator, micro.denominator)
        if micro.undivided is not None:
            value = value + micro.undivided
        logged = (value, micro.samples)
        if self.steps == 1:
            return value, logged
        return micro.numerator / jax.lax.stop_gradient(self._estimate(micro)), logged

    def _estimate(self, micro):
        if micro.denominator is None:
            return jnp.ones((), micro.numerator.dtype)
        estimate = micro.denominator * float(self.steps)
        return jnp.where(estimate > 0, estimate, jnp.ones_like(estimate))

    def after_micro_batch(self, grads, micro, trainable, optimizer_values, values, hold=None):
        """`(trainable, optimizer_values, engine values)` after one micro-batch.

        `hold` (a traced boolean, or None): the micro-batch changes nothing,
        neither the weights, the optimizer state, the accumulators nor the
        statistics (a NaNOnsetDetector's record after an onset).
        """
        sums, stats = values[: len(self.sums)], values[-1]
        grads = [g.astype(dtype) for g, dtype in zip(grads, self.sum_dtypes)]
        scale = self._scale(optimizer_values)
        if scale is not None:
            grads = [g / scale.astype(g.dtype) for g in grads]
        denominator = (
            jnp.zeros((), self.dtype) if micro.denominator is None else micro.denominator
        )
        step_totals = jnp.stack(
            [
                micro.numerator.astype(self.dtype),
                denominator.astype(self.dtype),
                micro.samples.astype(self.dtype),
                jnp.ones((), self.dtype),
            ]
        )
        if self.steps == 1:
            loss = micro.numerator if micro.denominator is None else _gradients.divide_no_nan(
                micro.numerator, micro.denominator
            )
            trainable, optimizer_values, stats = self._update(
                grads, loss, step_totals[2], trainable, optimizer_values, stats, hold
            )
            return trainable, optimizer_values, [stats]
        totals = values[-2]
        estimate = self._estimate(micro)
        first = totals[3] == 0
        sums = [
            jnp.where(first, g * estimate.astype(g.dtype), s + g * estimate.astype(g.dtype))
            for s, g in zip(sums, grads)
        ]
        totals = jnp.where(first, step_totals, totals + step_totals)
        if hold is not None:
            sums = [jnp.where(hold, old, new) for new, old in zip(sums, values[: len(self.sums)])]
            totals = jnp.where(hold, values[-2], totals)
        self.normalized = micro.denominator is not None

        def update(operands):
            trainable, optimizer_values, sums, totals, stats = operands
            trainable, optimizer_values, stats = self._update_from_sums(
                sums, totals, trainable, optimizer_values, stats
            )
            return trainable, optimizer_values, sums, jnp.zeros_like(totals), stats

        trainable, optimizer_values, sums, totals, stats = jax.lax.cond(
            totals[3] >= self.steps,
            update,
            lambda operands: operands,
            (trainable, optimizer_values, sums, totals, stats),
        )
        return trainable, optimizer_values, [*sums, totals, stats]

    def _flush_values(self, trainable, optimizer_values, values, reads_norm):
        # `reads_norm` (static) is not used here: it keys jax.jit's cache, so
        # that the flush is traced again when `_reads_norm()` changes.
        del reads_norm
        sums, totals, stats = values[: len(self.sums)], values[-2], values[-1]
        trainable, optimizer_values, stats = self._update_from_sums(
            sums, totals, trainable, optimizer_values, stats
        )
        return trainable, optimizer_values, [*sums, jnp.zeros_like(totals), stats]

    def _update_from_sums(self, sums, totals, trainable, optimizer_values, stats):
        numerator, denominator, samples = totals[0], totals[1], totals[2]
        if getattr(self, "normalized", True):
            grads = [_gradients.divide_no_nan(s, denominator.astype(s.dtype)) for s in sums]
            loss = _gradients.divide_no_nan(numerator, denominator)
        else:
            grads, loss = list(sums), numerator
        return self._update(grads, loss, samples, trainable, optimizer_values, stats)

    def _update(self, grads, loss, samples, trainable, optimizer_values, stats, hold=None):
        """Adds the weight penalty's gradient, clips, then applies or skips; updates the stats.

        With `hold` true the update changes nothing (see `after_micro_batch`).
        """
        model = self.model
        old_stats = stats
        grads = self._add_weight_regularization(grads, trainable)
        if self._reads_norm():
            norm = _gradients.global_norm(grads, self.norm_by_concatenation)
            finite = jnp.isfinite(norm) & jnp.isfinite(loss)
        else:
            # Nothing reads the norm (no skip, clipping, loss scale or
            # statistics): the update waits for no reduction over the gradients.
            norm = jnp.zeros((), "float32")
            finite = jnp.ones((), bool)
        grads, clipped = _gradients.clip(
            grads, norm, model.global_clipnorm, model.clipnorm, model.clipvalue
        )

        def apply(operands):
            trainable, optimizer_values = operands
            variables = model.trainable_variables
            cast = [g.astype(v.dtype) for g, v in zip(grads, variables)]
            scale = self._scale(optimizer_values)
            if scale is not None:
                # The LossScaleOptimizer unscales, checks and grows its scale.
                cast = [g * scale.astype(g.dtype) for g in cast]
            return tuple(
                model.optimizer.stateless_apply(optimizer_values, cast, trainable)
            )

        # With action="restore", a NaNOnsetDetector's onset update is held as
        # a skip would be.
        skips = model.skip_nonfinite or (
            self.watch is not None and self.watch.request.action == "restore"
        )
        if self.loss_scale is not None:
            # It skips non-finite updates itself and halves its scale.
            updated = apply((trainable, optimizer_values))
            if hold is not None:
                updated = jax.tree_util.tree_map(
                    lambda new, old: jnp.where(hold, old, new),
                    updated,
                    (list(trainable), list(optimizer_values)),
                )
            trainable, optimizer_values = updated
            applied = finite.astype("float32")
        elif skips or hold is not None:
            keep = finite if skips else jnp.ones((), bool)
            if hold is not None:
                keep = keep & ~hold
            state = (list(trainable), list(optimizer_values))
            if self.sharded_weights:
                # Under ModelParallel the update runs in one branch of a
                # lax.cond: selecting element-wise would keep the old and the
                # new sharded state alive together and pass over it once
                # more (benchmarks/bench_model_parallel.py's MLP on a (1, 2)
                # mesh of CPU devices: 1.35 of stock's step with the select,
                # 1.12 with the cond).
                trainable, optimizer_values = jax.lax.cond(
                    keep, apply, lambda operands: operands, state
                )
            else:
                # The update is computed whatever `finite` says, then
                # selected element-wise: XLA fuses the select into the
                # update's own loop, where a lax.cond copies the weights and
                # optimizer state in and out of its branches and blocks that
                # fusion. XLA's cost analysis of the MLP 64-256-256-10 step on
                # 2 CPU devices: 6.15 MB accessed with the cond, 4.46 MB with
                # the select, stock Keras 3.44 MB.
                updated = apply(state)
                trainable, optimizer_values = jax.tree_util.tree_map(
                    lambda new, old: jnp.where(keep, new, old), updated, state
                )
            applied = keep.astype("float32") if skips else jnp.ones((), "float32")
        else:
            trainable, optimizer_values = apply((trainable, optimizer_values))
            applied = jnp.ones((), "float32")
        stats = _rule.after_update(stats, applied, norm, clipped, samples)
        if hold is not None:
            stats = jnp.where(hold, old_stats, stats)
        return list(trainable), list(optimizer_values), stats

    def _reads_norm(self):
        """Whether the step needs the global gradient norm (read when traced)."""
        model = self.model
        return bool(
            model.skip_nonfinite
            or self.watch is not None  # a NaNOnsetDetector records non-finite updates
            or self.loss_scale is not None
            or model._stats_logged
            or model.global_clipnorm is not None
        )

    def _add_weight_regularization(self, grads, trainable):
        model = self.model
        if self.custom_loss or not any(
            getattr(v, "regularizer", None) is not None for v in model.trainable_variables
        ):
            return grads

        def penalty(values):
            with keras.StatelessScope(
                state_mapping=list(zip(model.trainable_variables, values))
            ):
                return _loss.weight_regularization(model)

        extra = jax.grad(penalty)(trainable)
        return [g + e.astype(g.dtype) for g, e in zip(grads, extra)]

    def _scale(self, optimizer_values):
        if self.loss_scale is None:
            return None
        optimizer = self.model.optimizer
        index = next(
            i for i, v in enumerate(optimizer.variables) if v is optimizer.dynamic_scale
        )
        return optimizer_values[index]


# The statistics at a fit()'s and an epoch's start, from those before.
_RESET_FIT = jax.jit(lambda values: [jnp.zeros_like(value) for value in values])
_RESET_EPOCH = jax.jit(lambda stats: stats * np.asarray(_rule.KEPT_ACROSS_EPOCHS, "float32"))


def _loss_scale_optimizer(optimizer):
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    return None

