"""JAX's train step for `SafeDistributedModel`, under `keras.distribution`.

On JAX every array is global: under `DataParallel` a batch is sharded across
the devices and XLA sums the gradient across them inside the compiled step,
so the step already sees the whole batch, as one device would. What this
module adds to Keras's JAX trainer is what it lacks there: exact
sample-weighted accumulation over micro-batches, clipping after it,
skipping non-finite updates, the update statistics, and batches that the
device count does not divide (placed whole on every device, see
`_jax_compat.uneven_batches_replicated`).

The accumulation state lives in `keras.Variable`s that Keras threads through
its jitted step with the metrics' variables (`metrics_variables` lists them
after the metrics'). What does not depend on the backend (the options, the
loss numerator/denominator rule in `_loss`, the epoch boundary) is in
keras_safe_dist/model/; TensorFlow's step is in
keras_safe_dist/backend/tensorflow/trainer.py.
"""

import contextlib

import jax
import keras

from keras_safe_dist import _compat
from keras_safe_dist.backend.jax import _compat as _jax_compat
from keras_safe_dist.backend.jax import _host_batches
from keras_safe_dist.backend.jax import _process_batch
from keras_safe_dist.backend.jax import _watchdog
from keras_safe_dist.backend.jax import processes
from keras_safe_dist.backend.jax import variable_layout
from keras_safe_dist.backend.jax._update import JAXUpdateEngine
from keras_safe_dist.update import _loss
from keras_safe_dist.update import statistics


class JAXTrainer(_compat.EpochEndOverride):
    """The JAX half of `SafeDistributedModel`: its step, placed before `keras.Model`."""

    def __setattr__(self, name, value):
        # Keras's JAX loops put each step's state on the model; Keras's
        # attribute tracking would walk all its arrays, on the host, every step.
        if name in _jax_compat.STEP_STATE_ATTRIBUTES:
            _jax_compat.set_untracked(self, name, value)
            return
        super().__setattr__(name, value)

    def _reset_step_state(self):
        # NaNOnsetDetector's in-step checks on TensorFlow; on JAX its record
        # is the update engine's `watch` (see `nan_watch`).
        self._nan_probe_request = None
        self.__dict__["_engine_hidden"] = False

    def _watches_nan_in_step(self):
        """True: on JAX the step keeps a NaNOnsetDetector's record on the device."""
        return True

    @property
    def replica_jit_compile(self):
        """False on JAX: Keras's `jit_compile` compiles the whole step, as in stock Keras."""
        return False

    def _check_placement(self, where, optimizer=None, metrics=()):
        """No strategy scope on JAX: variables created before the distribution are laid out later.

        See `variable_layout.lay_out`, called before each step is compiled.
        """

    def _check_fit_data(self, x, batch_size):
        """Every batch size works on JAX (see `_jax_compat.uneven_batches_replicated`)."""

    @property
    def metrics_variables(self):
        """The metrics' variables, then the update engine's (Keras threads both through its step)."""
        variables = super().metrics_variables
        engine = self._update_engine
        if engine is None or self.__dict__.get("_engine_hidden"):
            return variables
        return variables + engine.state_variables

    @contextlib.contextmanager
    def _engine_out_of_metrics(self):
        self.__dict__["_engine_hidden"] = True
        try:
            yield
        finally:
            self.__dict__["_engine_hidden"] = False

    # Every way data enters Keras's JAX trainer: batches the data axis does
    # not divide are placed whole on each device.

    # With several processes, each passes its own data: they agree on each
    # step's global batch first (see `_shares`).

    def fit(self, *args, **kwargs):
        processes.check_joined("fit")
        processes.check_same_call("fit", self, _epochs(args, kwargs))
        with contextlib.ExitStack() as stack:
            stack.enter_context(_jax_compat.uneven_batches_replicated())
            stack.enter_context(_process_batch.agreed_iterators())
            # A NaNOnsetDetector keeps the host batches for its replay (in one process).
            stack.enter_context(_host_batches.host_batches_told())
            stack.enter_context(_failures_reported())
            stack.enter_context(self._fitting())
            return super().fit(*args, **kwargs)

    @contextlib.contextmanager
    def _fitting(self):
        # Read by the train function: only `fit()` takes the variables' values
        # off the model for its steps (`train_on_batch()` leaves them there).
        self.__dict__["_in_fit"] = True
        _jax_compat.forget_step_state(self)
        try:
            yield
        finally:
            self.__dict__["_in_fit"] = False

    def evaluate(self, *args, **kwargs):
        processes.check_joined("evaluate")
        processes.check_same_call("evaluate", self)
        with _jax_compat.uneven_batches_replicated(), _process_batch.agreed_iterators(), _failures_reported():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        if jax.process_count() > 1 and self.steps_per_execution != 1:
            raise ValueError(
                "With several processes, predict() runs one step per execution, so "
                "that each process gets its own rows back. Received: "
                f"steps_per_execution={self.steps_per_execution}. Compile with "
                "steps_per_execution=1 for predict()."
            )
        processes.check_joined("predict")
        processes.check_same_call("predict", self)
        with _jax_compat.uneven_batches_replicated(), _process_batch.agreed_iterators(), _failures_reported():
            return super().predict(*args, **kwargs)

    def _new_distribution(self, kind):
        """Whether the distribution changed since the `kind` function was compiled.

        Keras keeps a compiled step across `set_distribution(...)` calls, and
        it then fails on the variables laid out for the old one ("Received
        incompatible devices for jitted computation"): such a step is
        compiled again, after the variables are laid out on the new one.
        """
        current = keras.distribution.distribution()
        made = self.__dict__.setdefault("_compiled_under", {})
        changed = kind in made and made[kind] is not current
        made[kind] = current
        return changed

    def make_test_function(self, force=False):
        force = self._new_distribution("test") or force
        if self.test_function is None or force:
            variable_layout.lay_out(self)
        return super().make_test_function(force)

    def make_predict_function(self, force=False):
        force = self._new_distribution("predict") or force
        if self.predict_function is None or force:
            variable_layout.lay_out(self)
        super().make_predict_function(force)
        function = self.predict_function
        if jax.process_count() == 1 or getattr(function, "_local_rows", False):
            return function

        def predict_function(state, iterator):
            # Each process gets back its own rows of the global batch.
            outputs, state = function(state, iterator)
            sizes, process = _process_batch.last_step()
            rows = keras.tree.map_structure(
                lambda output: _process_batch.local_rows(output, sizes, process), outputs
            )
            return rows, state

        predict_function._local_rows = True
        self.predict_function = predict_function
        return predict_function

    def train_on_batch(self, *args, **kwargs):
        with _jax_compat.uneven_batches_replicated():
            return super().train_on_batch(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        with _jax_compat.uneven_batches_replicated():
            return super().test_on_batch(*args, **kwargs)

    def predict_on_batch(self, *args, **kwargs):
        with _jax_compat.uneven_batches_replicated():
            return super().predict_on_batch(*args, **kwargs)

    def make_train_function(self, force=False):
        engine = self._update_engine
        if engine is not None:
            engine.check_trainable()  # a layer's `trainable` set since compile()
        if self._new_distribution("train"):
            force = True  # the variables are laid out on the new distribution first
        if self._stats_logged != self._stats_requested:
            force = True  # the update statistics were asked for, or no more
        if engine is not None and engine.nan_request != self._nan_probe_request:
            force = True  # a NaNOnsetDetector joined, left or changed
        if self.train_function is not None and not force:
            return self.train_function
        self._stats_logged = self._stats_requested
        if not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        # Variables created before the distribution was set: on it, once;
        # then the engine's own, laid out as those variables are.
        variable_layout.lay_out(self)
        if engine is None or engine.stale(self._nan_probe_request):
            if engine is not None:
                engine.flush()
            self._update_engine = JAXUpdateEngine(self, self._nan_probe_request)
            self._nan_link.watch = self._update_engine.watch
            self._nan_link.statistics = self._update_engine.stats
            variable_layout.lay_out(self)
        self._update_engine.read_layout()
        super().make_train_function(force=True)
        step_function = self.train_function
        # The detector replays the onset's micro-batches: keep references to
        # the last steps' batches (no copy, no host transfer). And the record
        # leaves the logs before Keras sees them.
        watch = self._update_engine.watch

        def train_function(state, iterator):
            try:
                if watch is None:
                    return step_function(state, iterator)
                logs, new_state = step_function(state, _Recorded(iterator, watch))
            except BaseException:
                # A step refused while traced (a loss or sample weights this
                # step cannot use): the model keeps its variables' values.
                if self.__dict__.get("_in_fit"):
                    _jax_compat.put_back_at_sync(self, state)
                raise
            watch.take(logs)
            return logs, new_state

        self.train_function = train_function
        return self.train_function

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics_values = state
        engine = self._update_engine
        split = len(metrics_values) - len(engine.state_variables)
        metrics_values, engine_values = metrics_values[:split], metrics_values[split:]
        own = len(engine.variables)
        engine_values, watch_values = engine_values[:own], engine_values[own:]
        trainable0, non_trainable0, optimizer0 = trainable, non_trainable, optimizer_values
        stats0 = engine_values[-1]
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with self._engine_out_of_metrics():
            grad_fn = jax.value_and_grad(self._objective, has_aux=True)
            (_, aux), grads = grad_fn(
                trainable,
                non_trainable,
                metrics_values,
                optimizer_values,
                x,
                y,
                sample_weight,
            )
            micro, logged, y_pred, non_trainable, metrics_values = aux
            hold = frozen = None
            if engine.watch is not None:
                # A NaNOnsetDetector's record: after an onset the step changes nothing.
                frozen = engine.watch.frozen(watch_values[0])
                hold = engine.watch.hold(watch_values, logged[0])
                non_trainable = [
                    jax.numpy.where(frozen, old, new) for new, old in zip(non_trainable, non_trainable0)
                ]
            trainable, optimizer_values, engine_values = engine.after_micro_batch(
                grads, micro, trainable, optimizer_values, engine_values, hold
            )
            # The logged loss's weight penalty: at the weights the micro-batch ran with.
            logs, metrics_values = self._metrics_logs(
                metrics_values, trainable0, logged, x, y, y_pred, sample_weight
            )
        if engine.watch is not None:
            watch_values = engine.watch.snapshot_after(
                watch_values, trainable0, optimizer0, frozen, logged[0]
            )
            watch_values = engine.watch.record(
                watch_values, stats0, engine_values, logged[0], logs.get("loss", logged[0]), frozen
            )
            engine.watch.log(logs, watch_values)
        if self._stats_logged:
            logs.update(engine.logs(engine_values))
        state = (
            trainable,
            non_trainable,
            optimizer_values,
            metrics_values + engine_values + watch_values,
        )
        return logs, state

    def test_step(self, state, data):
        """Keras's JAX `test_step`, with the update engine's state passed through."""
        trainable, non_trainable, metrics_values = state
        engine = self._update_engine
        split = len(metrics_values) - (0 if engine is None else len(engine.state_variables))
        metrics_values, engine_values = metrics_values[:split], metrics_values[split:]
        with self._engine_out_of_metrics():
            logs, state = super().test_step(
                (trainable, non_trainable, metrics_values), data
            )
        trainable, non_trainable, metrics_values = state
        return logs, (trainable, non_trainable, list(metrics_values) + list(engine_values))

    def _objective(
        self, trainable, non_trainable, metrics_values, optimizer_values, x, y, sample_weight
    ):
        """The scalar to differentiate for one micro-batch, and what the step needs besides."""
        kwargs = {"training": True} if _compat.call_has_training_arg(self) else {}
        y_pred, non_trainable, losses = self.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        mapping = [
            *zip(self.trainable_variables, trainable),
            *zip(self.non_trainable_variables, non_trainable),
            *zip(self.metrics_variables, metrics_values),
        ]
        engine = self._update_engine
        with keras.StatelessScope(state_mapping=mapping) as scope:
            with _jax_compat.losses_override(self, losses):
                if engine.custom_loss:
                    # An overridden compute_loss() gives the whole loss, as in
                    # stock Keras's JAX step (which also keeps what it writes).
                    loss = _compat.compute_loss(self, x, y, y_pred, sample_weight)
                    micro = _loss.custom_loss(loss, y_pred, engine.steps > 1)
                else:
                    micro = _loss.micro_batch_loss(self, y, y_pred, sample_weight)
        non_trainable = _current_values(scope, self.non_trainable_variables, non_trainable)
        metrics_values = _current_values(scope, self.metrics_variables, metrics_values)
        objective, logged = engine.objective(micro)
        if engine.loss_scale is not None:
            with keras.StatelessScope(
                state_mapping=list(zip(self.optimizer.variables, optimizer_values))
            ):
                objective = engine.loss_scale.scale_loss(objective)
        aux = (micro, logged, y_pred, non_trainable, metrics_values)
        return objective, aux

    def _metrics_logs(self, metrics_values, trainable, logged, x, y, y_pred, sample_weight):
        """Updates the loss tracker with the one-device loss, then the compiled metrics.

        The loss tracker weighs each batch by its samples, as stock Keras's
        JAX step does (for an overridden compute_loss() too). `trainable`:
        the weights the micro-batch ran with, whose penalty the loss includes.
        """
        value, weight = logged
        mapping = [
            *zip(self.trainable_variables, trainable),
            *zip(self.metrics_variables, metrics_values),
        ]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            # An overridden compute_loss() includes the weight penalty already.
            penalty = None if self._update_engine.custom_loss else _loss.weight_regularization(self)
            if penalty is not None:
                value = value + penalty
            _compat.loss_tracker(self).update_state(value, sample_weight=weight)
            logs = self.compute_metrics(x, y, y_pred, sample_weight)
        return logs, _current_values(scope, self.metrics_variables, metrics_values)

    def _update_log_names(self):
        return statistics.LOG_NAMES if self._stats_logged else ()


def _epochs(args, kwargs):
    """The `epochs` of a `fit(x, y, batch_size, epochs, ...)` call."""
    return kwargs.get("epochs", args[3] if len(args) > 3 else 1)


@contextlib.contextmanager
def _failures_reported():
    """With several processes, an exception here ends the others (see `_watchdog`)."""
    try:
        yield
    except BaseException as error:
        if jax.process_count() > 1:
            _watchdog.report_failure(error)
        raise


class _Recorded:
    """An iterator that gives `watch` each batch it yields, for the replay.

    Where the iterator tells the host arrays the data gave (`_host_batches`),
    a reference to those (or to their copy); otherwise a reference to the
    batch Keras placed on the devices.
    """

    def __init__(self, iterator, watch):
        self.iterator = iterator
        self.watch = watch

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.iterator)
        kept = getattr(self.iterator, "host_batch", None)
        self.watch.record_batch(batch if kept is None else kept)
        return batch


def _current_values(scope, variables, values):
    """The values `scope` assigned to `variables`, or `values` where it assigned none."""
    current = []
    for variable, value in zip(variables, values):
        new = scope.get_current_value(variable)
        current.append(value if new is None else new)
    return current
