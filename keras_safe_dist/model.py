"""`SafeDistributedModel`: exact gradient accumulation and clipping under tf.distribute."""

import inspect
import numbers
import warnings

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist import _loss
from keras_safe_dist import _shares
from keras_safe_dist import _validate
from keras_safe_dist import _xla
from keras_safe_dist import nan
from keras_safe_dist._update import UpdateEngine
from keras_safe_dist.audits import scope as _scope

_OPTIMIZER_OPTIONS = {
    "clipnorm": "clips each replica's gradient before the cross-replica all-reduce",
    "global_clipnorm": "clips each replica's gradient before the cross-replica all-reduce",
    "clipvalue": "clips each replica's gradient before the cross-replica all-reduce",
    "gradient_accumulation_steps": (
        "crashes under MirroredStrategy (a merge_call inside tf.cond) and "
        "weights uneven micro-batches equally"
    ),
}


@keras.saving.register_keras_serializable(package="keras_safe_dist")
class SafeDistributedModel(_compat.TrainerOverrides, keras.Model):
    """A `keras.Model` whose updates stay exact under `tf.distribute`.

    `fit()`'s `batch_size` is the micro-batch. The model sums each micro-batch
    gradient of the loss numerator on every replica, all-reduces once per
    optimizer update, divides by the group's loss denominator (as Keras would
    for one batch holding all samples of the group), adds the weight
    regularization gradient once, then clips and applies. Every update
    therefore equals the update stock Keras makes on one device for one big
    batch, whatever the number of replicas or how a batch splits across them.

    Use it like `keras.Model`: functionally
    (`SafeDistributedModel(inputs=..., outputs=..., ...)`, which also wraps the
    inputs and outputs of any Sequential or functional model) or by
    subclassing and implementing `call()`.

    Args:
        gradient_accumulation_steps: micro-batches per optimizer update. A
            partial group at the end of an epoch is applied, weighted by its
            samples. Integer >= 1.
        global_clipnorm: clip the global norm of the reduced gradient to this
            value. Float > 0 or None.
        clipnorm: clip each reduced gradient tensor to this norm. Float > 0 or
            None.
        clipvalue: clip each element of the reduced gradient to
            `[-clipvalue, clipvalue]`. Float > 0 or None.
        skip_nonfinite: when the reduced gradient or loss is not finite, leave
            weights and optimizer state untouched and count a skipped update.
            Under a `LossScaleOptimizer` such updates are always skipped.
        log_update_stats: add `grad_norm`, `clip_rate`, `skipped_updates` and
            `samples_per_update` to the logs of every step and epoch (and so
            to `History`, the progress bar and `train_on_batch`). Off by
            default, so the logs hold the same keys as stock Keras; a
            `Dashboard` or `NaNOnsetDetector` among `fit()`'s callbacks turns
            it on for that `fit()`.
        *args, **kwargs: passed to `keras.Model`.

    Raises:
        ValueError: for an invalid option, or two clipping modes at once.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(1)(inputs)
        model = SafeDistributedModel(
            inputs=inputs, outputs=outputs,
            gradient_accumulation_steps=4, global_clipnorm=1.0,
        )
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=32)  # one update per 4 * 32 samples
    ```
    """

    def __new__(cls, *args, **kwargs):
        if cls is SafeDistributedModel and _functional_arguments(args, kwargs):
            return keras.Model.__new__(SafeDistributedFunctional, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        gradient_accumulation_steps=1,
        global_clipnorm=None,
        clipnorm=None,
        clipvalue=None,
        skip_nonfinite=True,
        log_update_stats=False,
        **kwargs,
    ):
        options = _validate_options(
            gradient_accumulation_steps,
            global_clipnorm,
            clipnorm,
            clipvalue,
            skip_nonfinite,
            log_update_stats,
        )
        if _functional_arguments(args, kwargs):
            # Keras makes a subclass functional by rewriting the bases of every
            # class up to `keras.Model`, which would turn SafeDistributedModel
            # itself functional for the whole process. Stop one class earlier,
            # whether the inputs and outputs came to the constructor or from
            # the subclass's own `__init__`.
            _make_functional(type(self))
        super().__init__(*args, **kwargs)
        self._set_options(options)
        self._safe_dist_built_at = _scope.creation_site()

    def _set_options(self, options):
        self.gradient_accumulation_steps = options["gradient_accumulation_steps"]
        self.global_clipnorm = options["global_clipnorm"]
        self.clipnorm = options["clipnorm"]
        self.clipvalue = options["clipvalue"]
        self.skip_nonfinite = options["skip_nonfinite"]
        self.log_update_stats = options["log_update_stats"]
        self._update_engine = None
        # Whether the step logs the update statistics: set by fit() from the
        # option and the callbacks; the value the train function was built with.
        self._stats_requested = self.log_update_stats
        self._stats_logged = None
        # Set by fit() from a NaNOnsetDetector among the callbacks.
        self._nan_probe_request = None
        self._nan_probe = None
        # The step compiled with XLA on its own, when NaN checks run before it.
        self._xla_step = None
        # jit_compile=True on several replicas: each replica's pass under XLA.
        self._xla_replicas = False

    def get_config(self):
        config = super().get_config()
        config.update(
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            global_clipnorm=self.global_clipnorm,
            clipnorm=self.clipnorm,
            clipvalue=self.clipvalue,
            skip_nonfinite=self.skip_nonfinite,
            log_update_stats=self.log_update_stats,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        options = {
            name: config.pop(name) for name in _OPTION_DEFAULTS if name in config
        }
        model = super().from_config(config, custom_objects=custom_objects)
        model._set_options(
            _validate_options(**{**_OPTION_DEFAULTS, **options})
        )
        return model

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        """Same as `keras.Model.compile`, refusing what cannot work distributed.

        Called outside every strategy scope, it runs under the strategy that
        created the model, so an optimizer or metrics given by name and the
        loss tracker are created there wherever `compile()` is called. Objects built
        outside that strategy are refused here, with the line to move, instead
        of failing later inside TensorFlow. On several replicas
        `jit_compile=True` compiles each replica's forward and backward pass
        with XLA, keeping the all-reduce and the update outside it (then
        `model.jit_compile` reads False: Keras's whole-step compile is off),
        and `jit_compile="auto"` resolves to False.

        Args:
            optimizer: as in `keras.Model.compile`, without its own clipping
                or accumulation (give those to `SafeDistributedModel`).
            *args: the other arguments of `keras.Model.compile`.
            **kwargs: the other arguments of `keras.Model.compile`.

        Raises:
            ScopeError: when the model, the optimizer or a metric object was
                built outside the strategy that trains the model, or
                `compile()` is called inside another strategy's scope.
            ValueError: when the optimizer carries `clipnorm`,
                `global_clipnorm`, `clipvalue` or `gradient_accumulation_steps`;
                or, on several replicas, for `jit_compile=True` with a layer
                that synchronizes the replicas in its forward pass.

        Example:

        ```python
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")  # no clipnorm here
        ```
        """
        own = _compat.model_strategy(self)
        if own is not None and not tf.distribute.has_strategy():
            with own.scope():
                return self.compile(optimizer, *args, **kwargs)
        optimizer = keras.optimizers.get(optimizer)
        _check_optimizer(optimizer)
        metrics = [
            m
            for key in ("metrics", "weighted_metrics")
            for m in keras.tree.flatten(kwargs.get(key) or [])
            if isinstance(m, keras.metrics.Metric)
        ]
        _scope.check_scope(
            "SafeDistributedModel.compile()", self, optimizer=optimizer, metrics=metrics
        )
        super().compile(optimizer, *args, **kwargs)
        replicas = self.distribute_strategy.num_replicas_in_sync
        self._xla_replicas = False
        if replicas > 1 and self.jit_compile:
            # Keras would compile the whole step, cross-replica update
            # included, which XLA cannot hold; each replica's pass is
            # compiled instead, and only when asked for: on CPU it rarely
            # pays.
            if kwargs.get("jit_compile", "auto") is True and not self.run_eagerly:
                _xla.check_model(self)
                self._xla_replicas = True
            self.jit_compile = False
        self._update_engine = None

    def compile_from_config(self, config):
        """Compiles a loaded model as it was saved (optimizer, loss, metrics).

        As in Keras, a subclass with its own `compile()` is not compiled: a
        warning says to override `compile_from_config()` or to call
        `compile()` after loading.
        """
        if type(self).compile is not SafeDistributedModel.compile:
            warnings.warn(
                "`compile()` was not called as part of model loading "
                "because the model's `compile()` method is custom. "
                "All subclassed Models that have `compile()` "
                "overridden should also override "
                "`get_compile_config()` and `compile_from_config(config)`. "
                "Alternatively, you can "
                "call `compile()` manually after loading.",
                stacklevel=2,
            )
            return
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, *args, **kwargs):
        """Same as `keras.Model.fit`; `batch_size` is the micro-batch size.

        With `gradient_accumulation_steps=k` an optimizer update happens every
        k micro-batches (and for a partial group at the end of each epoch).
        The update statistics join the logs when `log_update_stats=True` or a
        callback asks for them (`Dashboard`, `NaNOnsetDetector`).

        Args:
            *args: the arguments of `keras.Model.fit`.
            **kwargs: the arguments of `keras.Model.fit`.

        Returns:
            A `keras.callbacks.History`, as `keras.Model.fit` returns.

        Raises:
            ScopeError: when the model, the optimizer, the loss scale or a
                metric was built outside the strategy that trains the model,
                or `fit()` is called inside another strategy's scope.
            ValueError: when a `tf.SparseTensor` input would leave a replica
                an empty share of the last batch, which TensorFlow's input
                pipeline cannot split.

        Example:

        ```python
        history = model.fit(x, y, batch_size=32, epochs=3)  # 32 samples per micro-batch
        ```
        """
        _scope.check_scope("SafeDistributedModel.fit()", self)
        _check_sparse_split(
            self.distribute_strategy.num_replicas_in_sync, *_fit_data(args, kwargs)
        )
        position = _FIT_CALLBACKS_POSITION
        args = list(args)
        if len(args) > position:
            args[position] = self._with_epoch_callback(args[position])
        else:
            kwargs["callbacks"] = self._with_epoch_callback(kwargs.get("callbacks"))
        return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """Same as `keras.Model.train_on_batch`: one micro-batch, stock log keys.

        With `gradient_accumulation_steps=k` the weights change on every k-th
        call. No callback is involved, so the update statistics are returned
        only with `log_update_stats=True`.
        """
        self._set_requests(None)
        return super().train_on_batch(*args, **kwargs)

    def _set_requests(self, callbacks):
        """What the step adds to the logs, from the option and the callbacks."""
        self._nan_probe_request = nan.request_from(callbacks)
        self._stats_requested = self.log_update_stats or _requests_update_stats(
            callbacks
        )

    def _with_epoch_callback(self, callbacks):
        self._set_requests(callbacks)
        callback = _EpochBoundary()
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callback.set_model(self)
            callback.set_params(callbacks.params)
            callbacks.callbacks.insert(0, callback)
            return callbacks
        return [callback] + list(callbacks or [])

    def make_train_function(self, force=False):
        built = self._nan_probe.request if self._nan_probe is not None else None
        if built != self._nan_probe_request:
            force = True  # a NaNOnsetDetector was added or removed
        if self._stats_logged != self._stats_requested:
            force = True  # the update statistics were asked for, or no more
        if self.train_function is not None and not force:
            return self.train_function
        self._stats_logged = self._stats_requested
        with self.distribute_strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)
        self._update_engine = UpdateEngine(self)
        self._nan_probe = None
        if self._nan_probe_request is not None:
            self._nan_probe = nan.NaNProbe(
                self, self._nan_probe_request, _compat.train_data_specs(self)
            )
        self._xla_step = None
        # With several steps per execution, the execution ends at the step
        # the detector reports, so that its batch and weights are still held.
        self._execution_ends = self._nan_probe
        try:
            return self._make_train_function(force)
        finally:
            self._execution_ends = None

    def _make_train_function(self, force):
        if self._nan_probe is None or not self.jit_compile:
            return super().make_train_function(force=force)
        # XLA cannot assign a batch of another shape to the capture variables,
        # and copies the weights where a plain step shares their buffers; the
        # weight check costs more inside the compiled step than before it
        # (docs/benchmarks.md). So compile the step with XLA on
        # its own, and capture, copy and check before it. Held in a plain
        # function: SavedModel exports a model's tf.function attributes, and
        # cannot export a train step.
        xla_step = tf.function(self._step, jit_compile=True, reduce_retracing=True)
        self._xla_step = lambda data: xla_step(data)
        self.jit_compile = False
        try:
            return super().make_train_function(force=force)
        finally:
            self.jit_compile = True

    def train_step(self, data):
        probe = self._nan_probe
        if probe is None:
            return self._step(data)
        weight_terms = probe.begin_step(data)
        if self._xla_step is None:
            return self._step(data, weight_terms)
        # The compiled step keeps every core busy: the weights' sums, run
        # beside it, slowed it down more than running them first.
        with tf.control_dependencies(weight_terms):
            logs = self._xla_step(data)
        return probe.with_weight_flags(logs, weight_terms)

    def _forward(self, x, training):
        """`(y_pred, keep)`: the forward pass, guarded against an empty share."""

        def call(inputs):
            if _compat.call_has_training_arg(self):
                return self(inputs, training=training)
            return self(inputs)

        return _shares.EmptyShareGuard(self).forward(x, call)

    def predict_step(self, data):
        """Stock `predict_step`, also on a replica whose share is empty."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, _ = self._forward(x, training=False)
        return y_pred

    def test_step(self, data):
        """Stock `test_step`, with the loss of each batch as one device sees it.

        Stock Keras averages each replica's loss with its sample count, which
        mis-weights it when a batch splits unevenly (by sample weights, or
        by a mask, or by `mean_with_sample_weight`). Here the replicas
        all-reduce their loss numerator and denominator (two scalars), so
        each batch's loss is the one-device value, weighted by its samples.
        """
        if (
            _compat.compute_loss_is_overridden(self)
            or _compat.compile_loss(self) is None
        ):
            return super().test_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, keep = self._forward(x, training=False)
        micro = _loss.kept(_loss.micro_batch_loss(self, y, y_pred, sample_weight), keep)
        context = tf.distribute.get_replica_context()
        denominator = micro.denominator
        if denominator is None:
            denominator = tf.zeros(())
        undivided = tf.zeros(()) if micro.undivided is None else micro.undivided
        numerator, denominator, undivided = tf.unstack(
            context.all_reduce(
                tf.distribute.ReduceOp.SUM,
                tf.stack([micro.numerator, denominator, undivided]),
            )
        )
        if micro.denominator is not None:
            numerator = tf.math.divide_no_nan(numerator, denominator) + undivided
        penalty = _loss.weight_regularization(self)
        if penalty is not None:
            numerator += penalty
        _compat.loss_tracker(self).update_state(numerator, sample_weight=micro.samples)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _step(self, data, weight_terms=()):
        engine = self._update_engine
        if self._xla_replicas and not engine.custom_loss and self._nan_probe is None:
            return self._multi_worker_logs(_xla.replica_step(self, data))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        probe = self._nan_probe
        with tf.GradientTape() as tape:
            y_pred, keep = self._forward(x, training=True)
            if engine.custom_loss:
                loss = _compat.compute_loss(self, x, y, y_pred, sample_weight)
                micro = _loss.custom_loss(loss, y_pred, engine.steps > 1)
            else:
                micro = _loss.micro_batch_loss(self, y, y_pred, sample_weight)
            micro = _loss.kept(micro, keep)
            contribution, objective, restore = engine.objective(micro)
        grads = tape.gradient(objective, self.trainable_weights)
        engine.after_micro_batch(grads, contribution, restore)
        if engine.custom_loss:
            self._track_custom_loss(loss, x)
        else:
            self._track_loss(micro)
        logs = self._step_logs(x, y, y_pred, sample_weight)
        if probe is not None:
            logs.update(
                probe.logs((x, y, sample_weight), micro.numerator, grads, weight_terms)
            )
        return self._multi_worker_logs(logs)

    def _step_logs(self, x, y, y_pred, sample_weight):
        """The metrics' logs of a train step, with the update statistics if logged."""
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self._stats_logged:
            logs.update(self._update_engine.logs())
        return logs

    def _multi_worker_logs(self, logs):
        if isinstance(self.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
            # Keras reduces step outputs across workers with
            # `strategy.reduce("MEAN", value, axis=0)`, which needs rank >= 1;
            # the reduced value is a scalar again.
            logs = keras.tree.map_structure(lambda v: tf.reshape(v, [1]), logs)
        return logs

    def _end_epoch_steps(self, logs):
        # A partial group pending at the end of an epoch (one of unknown
        # length, or stopped early) is applied here, before validation and the
        # epoch-end callbacks read the weights.
        engine = self._update_engine
        if engine is None or not engine.end_epoch():
            return logs
        if self._stats_logged and isinstance(logs, dict):
            logs = {**logs, **{k: float(v) for k, v in engine.logs().items()}}
        return logs

    def _update_log_names(self):
        names = UpdateEngine.LOG_NAMES if self._stats_logged else ()
        if self._nan_probe is not None:
            names += self._nan_probe.log_names
        return names

    def _track_custom_loss(self, loss, x):
        # As stock Keras logs the value of an overridden compute_loss().
        tracker = _compat.loss_tracker(self)
        samples = tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
        tracker.update_state(_compat.unscale_loss(loss), sample_weight=samples)

    def _track_loss(self, micro):
        penalty = _loss.weight_regularization(self)
        penalty = tf.zeros(()) if penalty is None else penalty
        tracker = _compat.loss_tracker(self)
        if micro.undivided is not None:
            # Keras < 3.14's summed activity penalties: the update's loss adds
            # every replica's (one scalar all-reduce, only in that case).
            context = tf.distribute.get_replica_context()
            penalty += context.all_reduce(tf.distribute.ReduceOp.SUM, micro.undivided)
        if micro.denominator is not None:
            value = tf.math.divide_no_nan(micro.numerator, micro.denominator)
            tracker.update_state(value + penalty, sample_weight=micro.denominator)
        else:
            # reduction="sum": log the mean over micro-batches of the sum over
            # all replicas' samples.
            replicas = self.distribute_strategy.num_replicas_in_sync
            tracker.update_state(
                micro.numerator * replicas + penalty, sample_weight=1.0 / replicas
            )


@keras.saving.register_keras_serializable(package="keras_safe_dist")
class SafeDistributedFunctional(SafeDistributedModel, _compat.Functional):
    """The class `SafeDistributedModel(inputs=..., outputs=...)` returns.

    A functional model (Keras's `Functional`) with `SafeDistributedModel`'s
    train step; its arguments are those of `SafeDistributedModel`. Not meant
    to be built by name: `isinstance(model, SafeDistributedModel)` holds.

    Example:

    ```python
    inputs = keras.Input((8,))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
    print(type(model).__name__)  # SafeDistributedFunctional
    ```
    """


# Legacy `.h5` files name a model's class without its package; register the
# bare names too, so `keras.models.load_model("model.h5")` needs no
# `custom_objects`, as for Keras's own models.
keras.saving.get_custom_objects().update(
    SafeDistributedModel=SafeDistributedModel,
    SafeDistributedFunctional=SafeDistributedFunctional,
)


class _EpochBoundary(keras.callbacks.Callback):
    """Resets per-fit and per-epoch counters.

    With a known number of steps the last micro-batch of an epoch already
    applies its partial group in-graph; the rest (an epoch of unknown length,
    or one stopped early) is applied when Keras collects the epoch's logs,
    before validation (`SafeDistributedModel._end_epoch_steps`), or at the
    latest here. It overrides no batch hook, so Keras keeps dispatching
    batches asynchronously.
    """

    def on_train_begin(self, logs=None):
        self.model._update_engine.begin_fit()
        self.warned = False

    def on_epoch_begin(self, epoch, logs=None):
        self.model._update_engine.begin_epoch(self.params.get("steps"))

    def on_epoch_end(self, epoch, logs=None):
        model = self.model
        engine = model._update_engine
        if engine.end_epoch() and logs is not None and model._stats_logged:
            logs.update(
                {name: float(value) for name, value in engine.logs().items()}
            )
        # Loss-scale overflows are routine; a NaNOnsetDetector reports skips
        # itself. Otherwise one small read per epoch.
        if (
            self.warned
            or not model.skip_nonfinite
            or engine.loss_scale is not None
            or model._nan_probe is not None
        ):
            return
        first = engine.first_skip()
        if first is not None:
            self.warned = True
            warnings.warn(_skip_message(epoch, *first, engine.steps), stacklevel=2)


def _skip_message(epoch, update, samples, steps):
    if steps == 1:
        where = f"batch {update}"
    else:
        first = update * steps
        where = f"update {update} (micro-batches {first} to {first + steps - 1})"
    return (
        f"SafeDistributedModel skipped a non-finite update at epoch {epoch}, "
        f"{where}: the gradient or loss of its {samples} samples was NaN or "
        "infinite, so they did not change the weights. Further skips in this "
        "fit() are counted without a warning (`skipped_updates` with "
        "`log_update_stats=True`). To find where the non-finite value began, "
        "add keras_safe_dist.callbacks.NaNOnsetDetector() to fit()'s callbacks."
    )


_OPTION_DEFAULTS = {
    "gradient_accumulation_steps": 1,
    "global_clipnorm": None,
    "clipnorm": None,
    "clipvalue": None,
    "skip_nonfinite": True,
    "log_update_stats": False,
}

_FIT_CALLBACKS_POSITION = (
    list(inspect.signature(keras.Model.fit).parameters).index("callbacks") - 1
)


def _validate_options(
    gradient_accumulation_steps,
    global_clipnorm,
    clipnorm,
    clipvalue,
    skip_nonfinite,
    log_update_stats,
):
    steps = _validate.integer_at_least(
        "gradient_accumulation_steps", gradient_accumulation_steps
    )
    clips = {
        "global_clipnorm": global_clipnorm,
        "clipnorm": clipnorm,
        "clipvalue": clipvalue,
    }
    for name, value in clips.items():
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not value > 0
            or value == float("inf")
        ):
            raise ValueError(
                f"`{name}` must be a finite number > 0 or None. "
                f"Received: {name}={value!r}"
            )
    given = {name: value for name, value in clips.items() if value is not None}
    if len(given) > 1:
        received = ", ".join(f"{name}={value!r}" for name, value in clips.items())
        raise ValueError(
            "Only one of `global_clipnorm`, `clipnorm` and `clipvalue` can be "
            f"set. Received: {received}"
        )
    for name, value in (
        ("skip_nonfinite", skip_nonfinite),
        ("log_update_stats", log_update_stats),
    ):
        if not isinstance(value, bool):
            raise ValueError(
                f"`{name}` must be True or False. Received: {name}={value!r}"
            )
    return {
        "gradient_accumulation_steps": int(steps),
        **{name: None if v is None else float(v) for name, v in clips.items()},
        "skip_nonfinite": skip_nonfinite,
        "log_update_stats": log_update_stats,
    }


def _check_optimizer(optimizer):
    inner = getattr(optimizer, "inner_optimizer", None)
    for candidate in (optimizer, inner):
        if candidate is None:
            continue
        for name, why in _OPTIMIZER_OPTIONS.items():
            value = getattr(candidate, name, None)
            if value is not None:
                raise ValueError(
                    f"The optimizer passed to SafeDistributedModel.compile() "
                    f"sets `{name}={value!r}`, which {why}. Pass `{name}` to "
                    f"SafeDistributedModel(...) instead and leave it unset on "
                    f"the optimizer. Received optimizer: {candidate.name}"
                )


def _fit_data(args, kwargs):
    """`(x, batch_size)` as `fit()` received them."""
    names = ("x", "y", "batch_size")
    given = dict(zip(names, args))
    return kwargs.get("x", given.get("x")), kwargs.get("batch_size", given.get("batch_size"))


def _check_sparse_split(replicas, x, batch_size):
    sparse = [t for t in keras.tree.flatten(x) if isinstance(t, tf.SparseTensor)]
    if replicas < 2 or not sparse:
        return
    samples = int(sparse[0].dense_shape[0])
    batch_size = 32 if batch_size is None else int(batch_size)
    last = samples % batch_size
    if 0 < last < replicas:
        raise ValueError(
            f"The last batch of this fit() holds {last} sample(s) for {replicas} "
            "replicas, so a replica would get an empty share of a "
            "tf.SparseTensor input, which TensorFlow's input pipeline cannot "
            "split (stock Keras fails with 'Serialized sparse should have at "
            f"least 1 serialized tensor'). Received: {samples} samples, "
            f"batch_size={batch_size}. Choose a batch_size that leaves at "
            f"least {replicas} samples in the last batch, or drop the "
            f"remainder (e.g. train on the first {samples - last} samples)."
        )


def _requests_update_stats(callbacks):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return any(
        getattr(callback, "requests_update_stats", False) is True
        for callback in keras.tree.flatten(callbacks or [])
    )


def _make_functional(cls):
    """Puts `SafeDistributedFunctional` in place of `SafeDistributedModel`.

    Rewrites the bases of `cls` and of its parents below SafeDistributedModel,
    as Keras does for a subclass of `keras.Model` built with `inputs` and
    `outputs`; SafeDistributedModel and classes outside its hierarchy are left
    as they are.
    """
    if cls is SafeDistributedModel:
        return SafeDistributedFunctional
    if not issubclass(cls, SafeDistributedModel) or issubclass(
        cls, SafeDistributedFunctional
    ):
        return cls
    cls.__bases__ = tuple(_make_functional(base) for base in cls.__bases__)
    return cls


def _functional_arguments(args, kwargs):
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )
