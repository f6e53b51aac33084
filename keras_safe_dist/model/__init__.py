"""`SafeDistributedModel`: exact gradient accumulation and clipping, under tf.distribute or keras.distribution."""

import warnings

import keras

from keras_safe_dist import _compat
from keras_safe_dist import nan
from keras_safe_dist.core import SafeModel
from keras_safe_dist.core import creation_site
from keras_safe_dist.model import _arguments
from keras_safe_dist.model import _callbacks
from keras_safe_dist.model import _from_model
from keras_safe_dist.model import _pending
from keras_safe_dist.nan import rows as _nan_rows
from keras_safe_dist.nan.link import DetectorLink
from keras_safe_dist.scale_out import distributed
from keras_safe_dist.update import _progbar
from keras_safe_dist.update import options as _options

# The backend's step, chosen here as Keras chooses its trainer in
# keras/src/models/model.py: each backend's folder is imported on its backend only.
_BACKEND = keras.backend.backend()
if _BACKEND == "tensorflow":
    from keras_safe_dist.backend.tensorflow.trainer import TensorFlowTrainer as Trainer
elif _BACKEND == "jax":
    from keras_safe_dist.backend.jax.trainer import JAXTrainer as Trainer
else:
    raise ImportError(
        "keras_safe_dist trains on Keras's TensorFlow and JAX backends. "
        f"Received: KERAS_BACKEND={_BACKEND!r}. Set KERAS_BACKEND=tensorflow "
        "or KERAS_BACKEND=jax before importing keras."
    )


def _option(name):
    """A property for the option `name` that validates an assignment as the constructor does."""

    def get(self):
        # The defaults until `__init__` sets them: a parent class may read
        # them sooner (KerasHub's Task compiles in its own `__init__`).
        return self.__dict__.get("_safe_dist_options", _options.DEFAULTS)[name]

    def set(self, value):
        self._assign_option(name, value)

    return property(get, set, doc=f"The `{name}` option; see the class docstring.")


@keras.saving.register_keras_serializable(package="keras_safe_dist")
class SafeDistributedModel(Trainer, keras.Model, SafeModel):
    """A `keras.Model` whose updates stay exact under `tf.distribute`.

    `fit()`'s `batch_size` is the micro-batch. The model sums each micro-batch
    gradient of the loss numerator on every replica, all-reduces once per
    optimizer update, divides by the group's loss denominator (as Keras would
    for one batch holding all samples of the group), adds the weight
    regularization gradient once, then clips and applies. Every update
    therefore equals the update stock Keras makes on one device for one big
    batch, whatever the number of replicas or how a batch splits across them.

    Use it like `keras.Model`: functionally
    (`SafeDistributedModel(inputs=..., outputs=..., ...)`), by subclassing and
    implementing `call()`, or over an existing Sequential or functional model
    with `SafeDistributedModel.from_model(model, ...)`.

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
            to `History`, the callbacks' logs and `train_on_batch`'s result;
            `fit()`'s progress bar leaves them out). Off by default, so the
            logs hold the same keys as stock Keras; a `Dashboard` among
            `fit()`'s callbacks, or on TensorFlow a `NaNOnsetDetector`, turns
            it on for that `fit()`.
        accumulation_dtype: the dtype of the sums that keep a group's
            micro-batch gradients (`gradient_accumulation_steps > 1`), one
            per trainable weight. None (the default): `"float32"` for
            `float16` and `bfloat16` weights, so that many micro-batches do
            not round away, and the weight's own dtype otherwise.
            `"bfloat16"`, `"float32"` or `"float64"`: that dtype for every
            floating weight's sum (not `"float16"`: the sums hold the
            group's summed gradient, which can pass its range).
            `"bfloat16"` halves the accumulators of `bfloat16` weights, at
            the cost of rounding each micro-batch's gradient into a
            `bfloat16` sum (docs/model.md states how much). Without
            accumulation there are no sums and it changes nothing.
        *args, **kwargs: passed to `keras.Model`.

    Each option can also be assigned after construction
    (`model.clipnorm = 0.5`): the value is checked as the constructor checks
    it, a partial accumulation group still pending (from `train_on_batch()`
    or an interrupted `fit()`) is applied first, with the options it was
    accumulated under, and the next `fit()` or `train_on_batch()` trains as a
    model constructed with the new options would. One clipping mode at a
    time: to switch, set the one in use to None first
    (`model.clipnorm = None; model.global_clipnorm = 1.0`).

    Raises:
        ValueError: for an invalid option, or two clipping modes at once;
            also when one is assigned.

    Example, on TensorFlow (the model, optimizer and metrics in the
    strategy's scope):

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

    On JAX (`KERAS_BACKEND=jax`), the distribution set before the model is
    built:

    ```python
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    inputs = keras.Input((8,))
    model = SafeDistributedModel(
        inputs, keras.layers.Dense(1)(inputs),
        gradient_accumulation_steps=4, global_clipnorm=1.0,
    )
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=32)
    ```
    """

    gradient_accumulation_steps = _option("gradient_accumulation_steps")
    global_clipnorm = _option("global_clipnorm")
    clipnorm = _option("clipnorm")
    clipvalue = _option("clipvalue")
    skip_nonfinite = _option("skip_nonfinite")
    log_update_stats = _option("log_update_stats")
    accumulation_dtype = _option("accumulation_dtype")

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
        accumulation_dtype=None,
        **kwargs,
    ):
        # The functional class is an implementation detail: name the one called.
        functional = type(self) is SafeDistributedFunctional
        called = SafeDistributedModel if functional else type(self)
        # A subclass's or a mixed-in parent's own arguments pass through here
        # (a KerasHub backbone's `layer_norm_epsilon`): only the functional
        # constructor, which gives them all to Keras, reads other libraries' names.
        _options.refuse_misspelled(called.__name__, kwargs, other_libraries=functional)
        options = _options.validate(
            gradient_accumulation_steps,
            global_clipnorm,
            clipnorm,
            clipvalue,
            skip_nonfinite,
            log_update_stats,
            accumulation_dtype,
        )
        if _functional_arguments(args, kwargs):
            # Keras makes a subclass functional by rewriting the bases of every
            # class up to `keras.Model`, which would turn SafeDistributedModel
            # itself functional for the whole process. Stop one class earlier,
            # whether the inputs and outputs came to the constructor or from
            # the subclass's own `__init__`.
            _make_functional(type(self))
        bases = SafeDistributedModel.__bases__
        try:
            super().__init__(*args, **kwargs)
        finally:
            # A parent mixed in after SafeDistributedModel may pass inputs and
            # outputs to keras.Model.__init__ itself (a KerasHub Task does);
            # Keras then makes every class up to keras.Model functional,
            # SafeDistributedModel included. Undo that for SafeDistributedModel,
            # also when the parent's __init__ fails: this class is functional
            # through that parent.
            SafeDistributedModel.__bases__ = bases
        self._set_options(options)
        self._safe_dist_built_at = creation_site()

    def _end_epoch_steps(self, logs):
        """Applies a partial group pending at the end of an epoch; returns the logs.

        The group (one of unknown length, or stopped early) is applied here,
        before validation and the epoch-end callbacks read the weights, and
        the epoch's update statistics join the logs when they are logged.
        Both backends' `TrainerOverrides` call it.
        """
        engine = self._update_engine
        if engine is None or not engine.end_epoch():
            return logs
        if self._stats_logged and isinstance(logs, dict):
            logs = {**logs, **{k: float(v) for k, v in engine.logs().items()}}
        return logs

    def _set_options(self, options):
        # Past Keras's attribute tracking, which would wrap the dict.
        self.__dict__["_safe_dist_options"] = dict(options)
        if getattr(self, "_nan_link", None) is None:
            # What a NaNOnsetDetector reads of this model: nothing else.
            self._nan_link = DetectorLink()
        self._update_engine = None
        # Whether the step logs the update statistics: set by fit() from the
        # option and the callbacks; the value the train function was built with.
        self._stats_requested = self.log_update_stats
        self._stats_logged = None
        self._reset_step_state()

    def _assign_option(self, name, value):
        current = self.__dict__.get("_safe_dist_options", _options.DEFAULTS)
        options = _options.validate(**{**current, name: value}, assigned=name)
        if options == current:
            return
        engine = self._update_engine
        if engine is not None:
            # The micro-batches of a pending group were accumulated under the
            # old options; they are applied with them, as at an epoch end.
            engine.flush()
        self.__dict__["_safe_dist_options"] = options
        # The step is traced with the options: the next fit() or
        # train_on_batch() builds it, and a new update engine, again.
        self.train_function = None
        self._update_engine = None

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _options.DEFAULTS})
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        options = {
            name: config.pop(name) for name in _options.DEFAULTS if name in config
        }
        if custom_objects is None:
            # A parent mixed in after this class may take no custom_objects
            # (KerasHub's Task.from_config); Keras's loader passes none.
            model = super().from_config(config)
        else:
            model = super().from_config(config, custom_objects=custom_objects)
        model._set_options(
            _options.validate(**{**_options.DEFAULTS, **options})
        )
        return model

    @classmethod
    def from_model(cls, model, *, input_shape=None, **options):
        """A `SafeDistributedModel` with the layers and weights of `model`.

        Takes a `keras.Sequential` (with an `Input`, or built, or unbuilt
        given `input_shape`) or a functional `keras.Model`, and returns a
        functional `SafeDistributedModel` over the same layer objects: the
        same variables, so the same predictions, and training it trains
        `model`'s layers. Neither the compile state nor the optimizer is
        copied: compile the result, giving `SafeDistributedModel` the
        clipping or accumulation the optimizer had. A `SafeDistributedModel`
        keeps its options, except those given (a clipping mode given
        replaces its own). The class is not copied, so a class that
        overrides `compute_loss`, `train_step` or `test_step` is refused:
        mix `SafeDistributedModel` into that class instead. Call it in the scope
        of the strategy that built `model` (or will build it, for an
        unbuilt Sequential).

        Args:
            model: a Sequential or functional `keras.Model`.
            input_shape: the shape of one sample, without the batch
                dimension (as `keras.Input(shape=...)` takes it), to build a
                Sequential that has no `Input` and was never built; ignored
                otherwise unless it differs from the model's.
            **options: the options of `SafeDistributedModel`
                (`gradient_accumulation_steps`, `global_clipnorm`, ...).

        Returns:
            A `SafeDistributedModel` (a `SafeDistributedFunctional`) named
            as `model`.

        Raises:
            TypeError: when `model` is not a `keras.Model`, or is a
                subclassed model (subclass `SafeDistributedModel` instead);
                for a keyword that is not an option, naming the closest; for
                a class that overrides `compute_loss`, `train_step` or
                `test_step`.
            ValueError: for an unbuilt Sequential without `input_shape`, an
                `input_shape` that differs from the model's, or an invalid
                option.
            ScopeError: when called inside a strategy's scope while the
                model's variables were built outside it.

        Example:

        ```python
        with strategy.scope():
            sequential = keras.Sequential([keras.layers.Dense(32), keras.layers.Dense(1)])
            model = SafeDistributedModel.from_model(
                sequential, input_shape=(8,), global_clipnorm=1.0
            )
            model.compile(optimizer="adam", loss="mse")
        ```
        """
        unknown = [name for name in options if name not in _options.DEFAULTS]
        if unknown:
            raise TypeError(
                f"{cls.__name__}.from_model() got unexpected keyword arguments {unknown}"
                f"{_options.closest(unknown)}. It takes `input_shape` and the options "
                f"{sorted(_options.DEFAULTS)}."
            )
        _from_model.refuse_overridden_steps(model)
        if isinstance(model, SafeDistributedModel):
            # Its options are kept unless given; a clipping mode given replaces its own.
            kept = dict(model.__dict__.get("_safe_dist_options", _options.DEFAULTS))
            if any(options.get(name) is not None for name in _options.CLIPPING):
                kept.update(dict.fromkeys(_options.CLIPPING))
            options = {**kept, **options}
        inputs, outputs = _from_model.model_graph(model, input_shape)
        wrapped = cls(inputs=inputs, outputs=outputs, name=model.name, **options)
        wrapped._check_placement("SafeDistributedModel.from_model()")
        _from_model.warn_if_saved_twice(model, wrapped)
        return wrapped

    def compile(self, *args, **kwargs):
        """Same as `keras.Model.compile`, refusing what cannot work distributed.

        The defaults are those of the next `compile()` in the class's order:
        stock Keras's, or, for a class that mixes `SafeDistributedModel` into
        another model class (a KerasHub task), that class's (`optimizer="auto"`).

        Called outside every strategy scope, it runs under the strategy that
        created the model, so an optimizer or metrics given by name and the
        loss tracker are created there wherever `compile()` is called. Objects built
        outside that strategy are refused here, with the line to move, instead
        of failing later inside TensorFlow. On several replicas
        `jit_compile=True` compiles each replica's forward and backward pass
        with XLA, keeping the all-reduce and the update outside it (then
        `model.jit_compile` reads False: Keras's whole-step compile is off),
        and `jit_compile="auto"` resolves to False. A partial accumulation
        group pending from `train_on_batch()` is applied first, with the
        optimizer it was accumulated for.

        Args:
            *args: the arguments of `keras.Model.compile`; the optimizer
                without its own clipping or accumulation (give those to
                `SafeDistributedModel`).
            **kwargs: the arguments of `keras.Model.compile`.

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
        # `optimizer=None` is accepted, as by stock Keras, for a model that is
        # only evaluated, predicted or summarized; training refuses it.
        optimizer = args[0] if args else kwargs.get("optimizer", "default")
        if isinstance(optimizer, keras.optimizers.Optimizer):
            _options.check_optimizer(optimizer)
        engine = getattr(self, "_update_engine", None)
        if engine is not None:
            # A group pending from train_on_batch() or an interrupted fit() is
            # applied with the optimizer it was accumulated for, as when an
            # option is assigned.
            engine.flush()
        # The backend's trainer places and compiles (keras_safe_dist/backend/).
        super().compile(*args, **kwargs)
        try:
            _options.check_optimizer(self.optimizer)
        except ValueError:
            self.compiled = False
            raise
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
        callback asks for them (`Dashboard`, `NaNOnsetDetector`). A generator's
        or a `PyDataset`'s batches (`x`, `validation_data`) are copied as it
        gives them, so one that fills the same arrays again trains on what it
        gave (docs/model.md).

        Args:
            *args: the arguments of `keras.Model.fit`.
            **kwargs: the arguments of `keras.Model.fit`.

        Returns:
            A `keras.callbacks.History`, as `keras.Model.fit` returns.

        Raises:
            ScopeError: when the model, the optimizer, the loss scale or a
                metric was built outside the strategy that trains the model,
                or `fit()` is called inside another strategy's scope.
            ValueError: when the model was compiled with `optimizer=None`;
                when a `tf.SparseTensor` input would leave a replica
                an empty share of the last batch, which TensorFlow's input
                pipeline cannot split; when `x` or `validation_data`
                holds no samples (arrays of 0 rows, a dataset of
                cardinality 0, a `PyDataset` of 0 batches); when
                `sample_weight` has two or more axes beyond the loss's
                per-sample values (Keras would spread it across the batch);
                when `batch_size` or `validation_batch_size` is not None or
                an integer >= 1; or when two `NaNOnsetDetector`s are among
                the callbacks.
            TypeError: when a callback class is given for an instance.

        Example:

        ```python
        history = model.fit(x, y, batch_size=32, epochs=3)  # 32 samples per micro-batch
        ```
        """
        self._check_has_optimizer("fit")
        strategy = distributed.strategy_of(self)
        _arguments.check_batch_sizes("fit", args, kwargs, ("batch_size", "validation_batch_size"))
        x = _arguments.given("fit", "x", args, kwargs)
        _arguments.check_has_samples("fit", x, strategy)
        validation = _arguments.given("fit", "validation_data", args, kwargs)
        if isinstance(validation, (tuple, list)) and validation:
            validation = validation[0]
        if validation is not None:
            _arguments.check_has_samples("fit", validation, strategy, argument="validation_data")
        self._check_fit_data(x, _arguments.given("fit", "batch_size", args, kwargs))
        position = _arguments.POSITIONS["fit"]["callbacks"]
        args = list(args)
        if len(args) > position:
            args[position] = self._with_epoch_callback(args[position])
        else:
            kwargs["callbacks"] = self._with_epoch_callback(kwargs.get("callbacks"))
        # For NaNOnsetDetector: where a bad sample is in the arrays given (references).
        self._nan_link.fit_arrays = _nan_rows.fit_arrays(args, kwargs)
        # For MultiWorkerBackupAndRestore: a resumed run that shuffles arrays
        # draws a new order for the remaining epochs.
        shuffle = kwargs.get("shuffle", True)
        if len(args) > _arguments.POSITIONS["fit"]["shuffle"]:
            shuffle = args[_arguments.POSITIONS["fit"]["shuffle"]]
        self.__dict__["_fit_shuffles"] = bool(shuffle) and self._nan_link.fit_arrays is not None
        args, kwargs = _arguments.fresh_batches("fit", args, kwargs, ("x", "validation_data"))
        try:
            return super().fit(*args, **kwargs)
        finally:
            self._nan_link.fit_arrays = None
            self.__dict__["_fit_shuffles"] = False

    def evaluate(self, *args, **kwargs):
        """Same as `keras.Model.evaluate`, refusing data that holds no samples.

        A generator's or a `PyDataset`'s batches are copied as it gives them
        (see `fit`).

        Args:
            *args: the arguments of `keras.Model.evaluate`.
            **kwargs: the arguments of `keras.Model.evaluate`.

        Returns:
            What `keras.Model.evaluate` returns.

        Raises:
            ValueError: when `x` holds no samples (arrays of 0 rows, a
                dataset of cardinality 0, a `PyDataset` of 0 batches),
                where stock Keras returns an empty list on TensorFlow and
                raises a bare `StopIteration` on JAX; or when `batch_size`
                is not None or an integer >= 1.
        """
        args, kwargs = _arguments.checked("evaluate", args, kwargs, distributed.strategy_of(self))
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """Same as `keras.Model.predict`, refusing data that holds no samples.

        A generator's or a `PyDataset`'s batches are copied as it gives them
        (see `fit`).

        Args:
            *args: the arguments of `keras.Model.predict`.
            **kwargs: the arguments of `keras.Model.predict`.

        Returns:
            What `keras.Model.predict` returns.

        Raises:
            ValueError: when `x` holds no samples (arrays of 0 rows, a
                dataset of cardinality 0, a `PyDataset` of 0 batches),
                where stock Keras fails with an `UnboundLocalError`
                ('batch_outputs'); or when `batch_size` is not None or an
                integer >= 1.
        """
        args, kwargs = _arguments.checked("predict", args, kwargs, distributed.strategy_of(self))
        return super().predict(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """Same as `keras.Model.train_on_batch`: one micro-batch, stock log keys.

        With `gradient_accumulation_steps=k` the weights change on every k-th
        call. No callback is involved, so the update statistics are returned
        only with `log_update_stats=True`. On several TensorFlow replicas the
        batch is split across them as `fit()` splits a batch (stock Keras
        gives each replica all of it), and the returned metrics are read over
        every replica's samples; `test_on_batch()` and `predict_on_batch()`
        do the same.
        """
        self._check_has_optimizer("train_on_batch")
        self._set_requests(None)
        return super().train_on_batch(*args, **kwargs)

    def save(self, *args, **kwargs):
        """Same as `keras.Model.save`; warns when a pending accumulation group is left out.

        The file holds the class, its options and the weights. Micro-batches
        accumulated but not yet applied (from `train_on_batch()`, or a
        `fit()` stopped mid-group) are not in it; a warning says so, once per
        model.
        """
        _pending.warn_on_save(self, "save")
        return super().save(*args, **kwargs)

    def save_weights(self, *args, **kwargs):
        """Same as `keras.Model.save_weights`; warns as `save()` does of a pending group."""
        _pending.warn_on_save(self, "save_weights")
        return super().save_weights(*args, **kwargs)

    def load_weights(self, *args, **kwargs):
        """Same as `keras.Model.load_weights`; a pending accumulation group is dropped first.

        Its gradients were computed on the weights being replaced; a warning
        says how many micro-batches were dropped.
        """
        _pending.drop_on_load(self, "load_weights")
        return super().load_weights(*args, **kwargs)

    def _check_has_optimizer(self, where):
        # Stock Keras fails later with "'NoneType' object has no attribute 'built'".
        if self.compiled and self.optimizer is None:
            raise ValueError(
                f"SafeDistributedModel.{where}() needs an optimizer: every update is "
                "applied with it. Received: compile(optimizer=None), which serves a "
                "model that is only evaluated, predicted or summarized. Compile with an "
                "optimizer or its name (e.g. optimizer='sgd') to train."
            )

    def _set_requests(self, callbacks):
        """What the step adds to the logs, from the option and the callbacks."""
        self._nan_probe_request = nan.request_from(callbacks)
        # Before Keras builds its callback list: a detector whose record the
        # step keeps reads no step's logs, and Keras's batch hooks stay asynchronous.
        nan.record_in_step(callbacks, self._nan_probe_request is not None and self._watches_nan_in_step())
        self._stats_requested = self.log_update_stats or _callbacks.requests_update_stats(
            callbacks
        )

    def _with_epoch_callback(self, callbacks):
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            # Keras takes one callback or nested lists of them, as
            # `keras.tree.flatten` reads them.
            callbacks = keras.tree.flatten(callbacks or [])
            classes = [c.__name__ for c in callbacks if isinstance(c, type)]
            if classes:
                raise TypeError(
                    "fit()'s `callbacks` must be callback instances. Received the "
                    f"class{'es' if len(classes) > 1 else ''} {', '.join(classes)}. Pass "
                    f"an instance, e.g. callbacks=[{classes[0]}()]."
                )
        self._set_requests(callbacks)
        callback = _callbacks.EpochBoundary()
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callback.set_model(self)
            callback.set_params(callbacks.params)
            callbacks.callbacks.insert(0, callback)
            return callbacks
        # Keras then adds no progress bar of its own.
        return [callback] + callbacks + _progbar.for_fit(callbacks, self._stats_requested)


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


def _copy_options(model, clone):
    """Gives a clone that `keras.models.clone_model` built the options of `model`."""
    if isinstance(model, SafeDistributedModel) and isinstance(clone, SafeDistributedModel):
        clone.__dict__["_safe_dist_options"] = dict(model.__dict__["_safe_dist_options"])
        clone.train_function = None


_compat.copy_options_on_clone(_copy_options)


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
