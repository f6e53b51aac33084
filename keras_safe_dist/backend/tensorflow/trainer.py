"""TensorFlow's train step for `SafeDistributedModel`, under `tf.distribute`.

Each replica runs the forward and backward pass on its share of the
micro-batch (`_step`), and the `TensorFlowUpdateEngine` (`_update.py`, beside this module)
accumulates, all-reduces once per update, clips and applies. What does not
depend on the backend (the options, their validation, the loss
numerator/denominator rule in `_loss`, the epoch boundary) is in
keras_safe_dist/model/; JAX's step is in keras_safe_dist/backend/jax/trainer.py.
"""

import contextlib

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist.audits import scope as _scope
from keras_safe_dist.backend.tensorflow import _accumulate
from keras_safe_dist.backend.tensorflow import _compat as _tf_compat
from keras_safe_dist.backend.tensorflow import _empty_shares
from keras_safe_dist.backend.tensorflow import _per_worker
from keras_safe_dist.backend.tensorflow import _replica_shares
from keras_safe_dist.backend.tensorflow import _xla
from keras_safe_dist.backend.tensorflow import nan_probe
from keras_safe_dist.backend.tensorflow._update import TensorFlowUpdateEngine
from keras_safe_dist.backend.tensorflow._update import all_reduced_totals
from keras_safe_dist.backend.tensorflow._update import loss_value
from keras_safe_dist.core import _warnings
from keras_safe_dist.update import _loss


class TensorFlowTrainer(_tf_compat.TrainerOverrides):
    """The TensorFlow half of `SafeDistributedModel`: its step, placed before `keras.Model`."""

    def _reset_step_state(self):
        # Set by fit() from a NaNOnsetDetector among the callbacks.
        self._nan_probe_request = None
        self._nan_link.probe = None
        # The step compiled with XLA on its own, when NaN checks run before it.
        self._xla_step = None
        # jit_compile=True on several replicas: each replica's pass under XLA.
        self._xla_replicas = False

    def _watches_nan_in_step(self):
        """False: TensorFlow's step returns the detector's flags in the logs, which Keras reads each step."""
        return False

    def _check_placement(self, where, optimizer=None, metrics=()):
        """Raises `ScopeError` for objects built outside the model's strategy."""
        if where.endswith("from_model()") and not tf.distribute.has_strategy():
            return
        _scope.check_scope(where, self, optimizer=optimizer, metrics=metrics)

    def compile(self, *args, **kwargs):
        # Called outside every strategy scope, compile() runs under the
        # strategy that created the model, so an optimizer or metrics given
        # by name and the loss tracker are created there.
        own = _compat.model_strategy(self)
        if own is not None and not tf.distribute.has_strategy():
            with own.scope():
                return self.compile(*args, **kwargs)
        optimizer = args[0] if args else kwargs.get("optimizer")
        metrics = [
            m
            for key in ("metrics", "weighted_metrics")
            for m in keras.tree.flatten(kwargs.get(key) or [])
            if isinstance(m, keras.metrics.Metric)
        ]
        self._check_placement(
            "SafeDistributedModel.compile()",
            optimizer=optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else None,
            metrics=metrics,
        )
        super().compile(*args, **kwargs)
        replicas = self.distribute_strategy.num_replicas_in_sync
        self._xla_replicas = False
        keeps_rows = self.gradient_accumulation_steps > 1 and bool(
            _accumulate.row_variables(self)
        )
        if self.jit_compile and (replicas > 1 or keeps_rows):
            # Keras would compile the whole step, cross-replica update
            # included, which XLA cannot hold, nor the rows of an Embedding's
            # gradients kept across micro-batches; each replica's pass is
            # compiled instead, and only when asked for: on CPU it rarely
            # pays.
            if kwargs.get("jit_compile", "auto") is True and not self.run_eagerly:
                _xla.check_model(self)
                self._xla_replicas = True
            self.jit_compile = False

    def fit(self, *args, **kwargs):
        # Per-worker data under MultiWorkerMirroredStrategy: every worker runs
        # the same steps, until the longest worker's data ends (_per_worker.py).
        args, kwargs = _per_worker.fit_arguments(self.distribute_strategy, args, kwargs)
        with _collectives_named(), _per_worker.epoch_ends_expected(args, kwargs):
            return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        args, kwargs = _per_worker.evaluate_arguments(self.distribute_strategy, args, kwargs)
        with _collectives_named(), _per_worker.epoch_ends_expected(args, kwargs):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        args, kwargs = _per_worker.predict_arguments(self.distribute_strategy, args, kwargs)
        with _collectives_named(), _per_worker.epoch_ends_expected(args, kwargs):
            return super().predict(*args, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        with _collectives_named():
            logs = super().train_on_batch(x, y, sample_weight, class_weight, return_dict=True)
        return self._batch_logs(logs, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        logs = super().test_on_batch(x, y, sample_weight, return_dict=True)
        return self._batch_logs(logs, return_dict)

    def _batch_logs(self, logs, return_dict):
        """A one-batch call's logs, its metrics over every replica's samples.

        The step's logs average the replicas' own metric results: a metric of a
        batch split 4 and 3 was the mean of two means, and a replica whose
        share was empty halved the loss. The metrics, reset before the batch,
        hold it whole: read across the replicas, as `fit()` reads an epoch's.
        """
        if self.distribute_strategy.num_replicas_in_sync > 1:
            logs.update({name: _python(value) for name, value in self.get_metrics_result().items()})
        return logs if return_dict else _compat.flatten_metrics_in_order(self, logs)

    def predict_on_batch(self, x):
        # Keras gives every replica the whole batch, and concatenates their
        # outputs: each row came back once per replica.
        return super().predict_on_batch(_replica_shares.split(self.distribute_strategy, x))

    def _check_fit_data(self, x, batch_size):
        self._check_placement("SafeDistributedModel.fit()")
        _check_sparse_split(self.distribute_strategy.num_replicas_in_sync, x, batch_size)

    @property
    def replica_jit_compile(self):
        """Whether each replica's forward and backward pass runs under XLA.

        `compile(jit_compile=True)` on several replicas (or on one device for
        a model whose Embedding rows are kept across accumulated
        micro-batches) compiles each replica's pass with XLA and keeps the
        all-reduce and the update outside it, so Keras's `model.jit_compile`
        reads False there. This flag reads True while that step is in use:
        False when `jit_compile` was not True, and from the `fit()` that
        dropped it (a `NaNOnsetDetector`, or an overridden `compute_loss()`,
        runs the plain step; a warning says so once). Read-only.

        Example:

        ```python
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        print(model.jit_compile, model.replica_jit_compile)  # False True on 2 replicas
        ```
        """
        return self._xla_replicas and self._xla_dropped_by() is None

    def _xla_dropped_by(self):
        """What makes the step drop the per-replica XLA pass, or None."""
        if self._nan_link.probe is not None:
            return "a NaNOnsetDetector (its in-step checks run in the plain step)"
        if _compat.compute_loss_is_overridden(self):
            return f"the overridden compute_loss() of {type(self).__name__}"
        return None

    def _warn_if_xla_dropped(self):
        """Says once per model that jit_compile=True is not applied, and why."""
        reason = self._xla_dropped_by() if self._xla_replicas else None
        if reason is None or self.__dict__.get("_xla_drop_warned"):
            return
        self.__dict__["_xla_drop_warned"] = True
        _warnings.warn(
            f"compile(jit_compile=True) asked for XLA, but with {reason} model "
            f"'{self.name}' trains with the plain step, without XLA "
            "(model.replica_jit_compile reads False while it does). Remove "
            "that to train each replica's pass under XLA."
        )

    def make_train_function(self, force=False):
        built = self._nan_link.probe.request if self._nan_link.probe is not None else None
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
        # XLA cannot resize a variable, so a step it compiles whole sums the
        # rows of sparse gradients.
        self._update_engine = TensorFlowUpdateEngine(self, rows=not self.jit_compile)
        self._nan_link.statistics = self._update_engine.stats
        self._nan_link.probe = None
        if self._nan_probe_request is not None:
            self._nan_link.probe = nan_probe.NaNProbe(
                self, self._nan_probe_request, _tf_compat.train_data_specs(self)
            )
        self._xla_step = None
        # With several steps per execution, the execution ends at the step
        # the detector reports, so that its batch and weights are still held.
        self._execution_ends = self._nan_link.probe
        self._warn_if_xla_dropped()
        try:
            return self._make_train_function(force)
        finally:
            self._execution_ends = None

    def _make_train_function(self, force):
        if self._nan_link.probe is None or not self.jit_compile:
            return super().make_train_function(force=force)
        # XLA cannot assign a batch of another shape to the capture variables,
        # and copies the weights where a plain step shares their buffers; the
        # weight check costs more inside the compiled step than before it
        # (docs/benchmarks.md). So compile the step with XLA on
        # its own, and capture, copy and check before it. Held in a plain
        # function: SavedModel exports a model's tf.function attributes, and
        # cannot export a train step.
        xla_step = _tf_compat.instance_function(self._step, jit_compile=True, reduce_retracing=True)
        self._xla_step = lambda data: xla_step(data)
        self.jit_compile = False
        try:
            return super().make_train_function(force=force)
        finally:
            self.jit_compile = True

    def train_step(self, data):
        probe = self._nan_link.probe
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

        return _empty_shares.EmptyShareGuard(self).forward(x, call)

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
        Under MultiWorkerMirroredStrategy the logs get the rank Keras's
        MEAN across workers needs, as the train step's do.
        """
        if (
            _compat.compute_loss_is_overridden(self)
            or _compat.compile_loss(self) is None
        ):
            return self._multi_worker_logs(super().test_step(data))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, keep = self._forward(x, training=False)
        micro = _loss.kept(_loss.micro_batch_loss(self, y, y_pred, sample_weight), keep)
        # All replicas' totals: one all-reduce of up to three scalars.
        numerator = loss_value(micro, all_reduced_totals(micro))
        penalty = _loss.weight_regularization(self)
        if penalty is not None:
            numerator += penalty
        _compat.loss_tracker(self).update_state(numerator, sample_weight=micro.samples)
        return self._multi_worker_logs(
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        )

    def _step(self, data, weight_terms=()):
        engine = self._update_engine
        if self._xla_replicas and not engine.custom_loss and self._nan_link.probe is None:
            return self._multi_worker_logs(_xla.replica_step(self, data))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        probe = self._nan_link.probe
        with tf.GradientTape() as tape:
            y_pred, keep = self._forward(x, training=True)
            if engine.custom_loss:
                loss = _compat.compute_loss(self, x, y, y_pred, sample_weight)
                micro = _loss.custom_loss(loss, y_pred, engine.steps > 1)
            else:
                micro = _loss.micro_batch_loss(self, y, y_pred, sample_weight)
            micro = _loss.kept(micro, keep)
            contribution, objective, restore, logged = engine.objective(micro)
        grads = tape.gradient(objective, self.trainable_weights)
        # The logged loss is the micro-batch's at the weights it ran with:
        # the penalty is read before the update changes them.
        penalty = None if engine.custom_loss else _loss.weight_regularization(self)
        engine.after_micro_batch(grads, contribution, restore)
        if engine.custom_loss:
            self._track_custom_loss(loss, x)
        else:
            self._track_loss(logged, penalty)
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

    def _update_log_names(self):
        names = TensorFlowUpdateEngine.LOG_NAMES if self._stats_logged else ()
        if self._nan_link.probe is not None:
            names += self._nan_link.probe.log_names
        return names

    def _track_custom_loss(self, loss, x):
        # As stock Keras logs the value of an overridden compute_loss().
        tracker = _compat.loss_tracker(self)
        samples = tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
        tracker.update_state(_compat.unscale_loss(loss), sample_weight=samples)

    def _track_loss(self, logged, penalty):
        """Logs a micro-batch's loss as stock Keras on one device logs a batch's.

        Args:
            logged: `(value, weight)` from the update engine: the loss over
                every replica's samples of the micro-batch, and this
                replica's sample count.
            penalty: the weight regularization penalty at the weights the
                micro-batch ran with (`_loss.weight_regularization`, read
                before the update), or None.
        """
        value, weight = logged
        if penalty is not None:
            value = value + penalty
        _compat.loss_tracker(self).update_state(value, sample_weight=weight)


def _python(value):
    """A float, as Keras returns a scalar log; other values as they are."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


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


_COLLECTIVES_COLLIDED = "Shape mismatch in the collective instance"


@contextlib.contextmanager
def _collectives_named():
    """Says what TensorFlow's collective shape mismatch means, and what to do.

    Each `MirroredStrategy` numbers its collectives from the same start; two
    strategies over the same devices in one process then give the same
    number to collectives of different shapes, and TensorFlow aborts them.
    Stock Keras fails the same way (two models of different sizes under two
    strategies); a second `gradient_accumulation_steps` is one such change.
    """
    try:
        yield
    except tf.errors.InvalidArgumentError as error:
        if _COLLECTIVES_COLLIDED not in str(error):
            raise
        raise RuntimeError(
            "TensorFlow aborted an all-reduce whose number another strategy's all-reduce "
            "of another shape had taken: two MirroredStrategy objects over the same devices "
            "in one process number their collectives alike, so stock Keras fails here too. "
            "Create one MirroredStrategy per process and build every model in its scope "
            f"(TensorFlow said: {_COLLECTIVES_COLLIDED} ...)."
        ) from error
