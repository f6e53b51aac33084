"""Each finding code of the static audits: triggered, and silent when set up right."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_safe_dist
from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.audits import CreationWatch
from keras_safe_dist.audits import aggregation_findings
from keras_safe_dist.audits import created_at
from keras_safe_dist.audits import current_scope_findings
from keras_safe_dist.audits import scope_findings

from conftest import mirrored_strategy
from conftest import strategy_for


class StateLayer(keras.layers.Layer):
    """A Dense-like layer with one extra variable of chosen settings."""

    def __init__(self, trainable_state=False, dtype_state="float32", **state):
        super().__init__(name="state_layer")
        self.state_settings = dict(trainable=trainable_state, dtype=dtype_state, **state)

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 1), initializer="ones")
        self.state = self.add_weight(shape=(), initializer="zeros", name="state", **self.state_settings)

    def call(self, x):
        return x @ self.kernel


class OnWriteMean(keras.metrics.Metric):
    """A metric whose state is mirrored (on-write) instead of replica-local."""

    def __init__(self, name="on_write_mean"):
        super().__init__(name=name)
        self.total = keras.Variable(0.0, name="total", trainable=False)

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(y_pred))

    def result(self):
        return self.total


class MeanSlotSGD(keras.optimizers.SGD):
    """An optimizer keeping a slot with mean aggregation."""

    def build(self, var_list):
        super().build(var_list)
        self.slots = [self.add_variable(v.shape, aggregation="mean", name="slot") for v in var_list]


def model_with(layer, strategy, optimizer="sgd", metrics=None):
    with strategy.scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, layer(inputs))
        model.compile(optimizer=optimizer, loss="mse", metrics=metrics)
        model.optimizer.build(model.trainable_variables)
    return model


def only(findings, code):
    matching = [f for f in findings if f.code == code]
    assert len(matching) == 1, findings
    return matching[0]


@pytest.mark.parametrize(
    "settings, code, subject",
    [
        ({"trainable_state": True, "aggregation": "mean"}, "AGG001", "state_layer/state"),
        ({"aggregation": "sum"}, "AGG003", "state_layer/state"),
    ],
)
def test_layer_variable_aggregation_findings(replicas, settings, code, subject):
    model = model_with(StateLayer(**settings), strategy_for(replicas))
    findings, variables = aggregation_findings(model)
    finding = only(findings, code)
    assert (finding.severity, finding.subject) == ("error", subject)
    assert {f.code for f in findings} == {code}
    state = next(v for v in variables if v.path == subject)
    assert state.aggregation == settings["aggregation"]
    assert state.container == ("plain" if replicas == 1 else "mirrored")


def test_integer_variable_with_mean_aggregation():
    model = model_with(StateLayer(dtype_state="int32", aggregation="mean"), strategy_for(1))
    findings, _ = aggregation_findings(model)
    finding = only(findings, "AGG006")
    assert (finding.severity, finding.subject) == ("warning", "state_layer/state")
    assert "cannot be trained on several replicas" in finding.message
    # The reason it is flagged: TensorFlow refuses it under a strategy.
    with pytest.raises(ValueError, match="aggregation=MEAN and a non-floating dtype is not supported"):
        model_with(StateLayer(dtype_state="int32", aggregation="mean"), mirrored_strategy())


def test_optimizer_slot_with_mean_aggregation(replicas):
    strategy = strategy_for(replicas)
    model = model_with(keras.layers.Dense(1, use_bias=False), strategy, optimizer=MeanSlotSGD(name="sgd"))
    findings, variables = aggregation_findings(model)
    finding = only(findings, "AGG002")
    assert (finding.severity, finding.subject) == ("error", "sgd/slot")
    assert "optimizer 'sgd'" in finding.message
    roles = {v.path: v.role for v in variables}
    assert roles["sgd/iteration"] == "optimizer-state"
    assert roles["sgd/slot"] == "optimizer-slot"


def test_metric_state_that_is_not_replica_local(replicas):
    strategy = strategy_for(replicas)
    with strategy.scope():
        metric = OnWriteMean()
    model = model_with(keras.layers.Dense(1), strategy, metrics=[metric])
    model.evaluate(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), verbose=0)
    findings, _ = aggregation_findings(model)
    finding = only(findings, "AGG004")
    assert (finding.severity, finding.subject) == ("warning", "total")
    assert finding.message.startswith("state of metric 'on_write_mean' with synchronization='auto'")


def test_variable_of_a_distributed_model_that_is_not_distributed():
    strategy = mirrored_strategy()
    with strategy.scope():
        # Named: an earlier test's Sequential would make the default "sequential_1".
        model = keras.Sequential([keras.layers.Dense(2, name="lazy")], name="sequential")
    model(np.ones((2, 3), "float32"))  # built on first call, outside the scope
    findings, variables = aggregation_findings(model)
    lazy = [f for f in findings if f.code == "AGG005"]
    assert [f.subject for f in lazy] == ["sequential/lazy/kernel", "sequential/lazy/bias"]
    assert lazy[0].severity == "error"
    assert "MirroredStrategy with 2 replicas" in lazy[0].message
    assert {v.container for v in variables} == {"plain"}


def test_variable_inventory_describes_every_variable(replicas):
    strategy = strategy_for(replicas)
    model = model_with(keras.layers.Dense(1, name="out"), strategy, optimizer="adam", metrics=["mae"])
    model.evaluate(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"), verbose=0)
    findings, variables = aggregation_findings(model)
    assert findings == []
    rows = {v.path: v for v in variables}
    kernel, total = rows["out/kernel"], rows["mean_absolute_error/total"]
    moment = next(v for v in variables if v.path.endswith("/out_kernel_momentum"))
    assert (kernel.owner, kernel.role, kernel.tf_aggregation) == ("out", "trainable", "NONE")
    assert (moment.owner, moment.role) == (f"optimizer '{model.optimizer.name}'", "optimizer-slot")
    assert (total.role, total.synchronization, total.tf_aggregation) == ("metric", "on_read", "SUM")
    expected = {"plain"} if replicas == 1 else {"mirrored", "on-read"}
    assert {v.container for v in variables} == expected
    assert len(kernel.devices) == replicas


def test_scope_findings_name_each_misplaced_object():
    strategy = mirrored_strategy()
    optimizer = keras.optimizers.Adam(name="adam")
    metric = keras.metrics.AUC(name="auc_outside")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs), name="outside")
    findings = scope_findings(model, strategy, optimizer=optimizer, metrics=[metric])
    assert [(f.code, f.severity, f.subject) for f in findings] == [
        ("SCOPE001", "error", "model 'outside'"),
        ("SCOPE002", "error", "optimizer 'adam'"),
        ("SCOPE003", "error", "metric 'auc_outside'"),
    ]
    assert findings[0].message.startswith("2 of 2 variables belong to no strategy")
    assert "MirroredStrategy with 2 replicas" in findings[0].message
    built = line_of(test_scope_findings_name_each_misplaced_object, 'keras.layers.Dense(1)(inputs), name="outside"')
    assert findings[0].fix == (
        "Move the line that builds model 'outside' (built at test_audits.py:"
        f"{built} in test_scope_findings_name_each_misplaced_object) into `with strategy.scope():`."
    )


def test_loss_scale_built_outside_the_scope():
    strategy = mirrored_strategy()
    with strategy.scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), name="loss_scale_optimizer")
    optimizer.build(model.trainable_variables)  # slots and scale outside the scope
    findings = scope_findings(model, strategy, optimizer=optimizer)
    scale = only(findings, "SCOPE004")
    assert (scale.severity, scale.subject) == ("error", "loss scale of optimizer 'loss_scale_optimizer'")
    assert scale.message.startswith("2 of 2 variables")


def test_everything_inside_the_scope_is_silent(replicas):
    strategy = strategy_for(replicas)
    with strategy.scope():
        metric = keras.metrics.AUC()
    model = model_with(keras.layers.Dense(1), strategy, optimizer="adam", metrics=[metric])
    assert scope_findings(model) == []
    # A stock model on 2 replicas: only the info on unevenly split batches.
    assert keras_safe_dist.audit(model).codes() == (() if replicas == 1 else ("DIST004",))


def test_audit_combines_the_static_checks():
    strategy = mirrored_strategy()
    with strategy.scope():
        inputs = keras.Input((3,))
        hidden = StateLayer(aggregation="sum")(inputs)
        frozen = keras.layers.BatchNormalization(name="frozen_bn")
        frozen.trainable = False
        model = keras.Model(inputs, frozen(hidden))
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse", metrics=[keras.metrics.AUC()])  # outside
    report = keras_safe_dist.audit(model)
    assert report.name == "pre-flight"
    assert report.codes() == ("AGG003", "AGG005", "SCOPE002", "SCOPE003", "MODE003", "DIST004")
    frozen_finding = only(report.findings, "MODE003")
    assert (frozen_finding.severity, frozen_finding.subject) == ("warning", "frozen_bn")


def test_audit_rejects_bad_input():
    with pytest.raises(TypeError, match="`model` must be a keras.Model. Received: model='model'"):
        keras_safe_dist.audit("model")
    model = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="audit\\(\\) needs a built model, but model 'sequential.*' has no variables"):
        keras_safe_dist.audit(model)
    model.build((None, 3))
    with pytest.raises(TypeError, match="`strategy` must be a tf.distribute.Strategy or None. Received: strategy='mirrored'"):
        keras_safe_dist.audit(model, strategy="mirrored")


def safe_model(strategy=None):
    inputs = keras.Input((3,))
    return SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), name="safe")


def test_compile_refuses_a_model_built_outside_the_scope_naming_its_line():
    model = safe_model()
    with pytest.raises(keras_safe_dist.ScopeError) as raised:
        with mirrored_strategy().scope():
            model.compile(optimizer="sgd", loss="mse")
    message = str(raised.value)
    assert message.startswith("SafeDistributedModel.compile() found objects built outside")
    assert "[SCOPE001] model 'safe': 2 of 2 variables belong to no strategy" in message
    assert "(built at test_audits.py:" in message and "in safe_model)" in message
    assert [f.code for f in raised.value.findings] == ["SCOPE001"]


def line_of(function, text):
    """The line number of the first line of `function` that holds `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def two_layers():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden), name="base")


def test_scope_error_names_the_lines_that_built_the_layers_of_a_wrapped_model():
    # Built outside, wrapped inside the scope: the wrapping line is not the
    # one to move.
    base = two_layers()
    with pytest.raises(keras_safe_dist.ScopeError) as raised:
        with mirrored_strategy().scope():
            model = SafeDistributedModel(inputs=base.inputs, outputs=base.outputs, name="wrapped")
            model.compile(optimizer="sgd", loss="mse")
    hidden = line_of(two_layers, 'name="hidden"')
    out = line_of(two_layers, 'name="out"')
    wrapped = line_of(test_scope_error_names_the_lines_that_built_the_layers_of_a_wrapped_model, 'name="wrapped"')
    (finding,) = raised.value.findings
    assert finding.code == "SCOPE001" and finding.message.startswith("4 of 4 variables belong to no strategy")
    assert finding.fix == (
        f"Move the lines that build model 'wrapped' (built at test_audits.py:{hidden} in two_layers, "
        f"test_audits.py:{out} in two_layers) into `with strategy.scope():`: its variables were "
        f"created there, not where the model was made (test_audits.py:{wrapped} in "
        "test_scope_error_names_the_lines_that_built_the_layers_of_a_wrapped_model)."
    )
    assert f"Fix: {finding.fix}" in str(raised.value)


def test_created_at_names_the_line_that_created_a_variable():
    dense = keras.layers.Dense(1)
    dense.build((None, 3))
    built = line_of(test_created_at_names_the_line_that_created_a_variable, "dense.build(")
    expected = f"test_audits.py:{built} in test_created_at_names_the_line_that_created_a_variable"
    assert created_at(dense.kernel) == created_at(dense.bias) == expected
    with mirrored_strategy().scope():
        mirrored = keras.Variable(1.0)  # its first copy carries the site
    assert created_at(mirrored).startswith("test_audits.py:")


def test_compile_refuses_an_optimizer_or_metric_built_outside_the_scope():
    strategy = mirrored_strategy()
    with strategy.scope():
        model = safe_model()
    with pytest.raises(keras_safe_dist.ScopeError, match=r"\[SCOPE002\] optimizer 'adam'"):
        model.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse")
    with pytest.raises(keras_safe_dist.ScopeError, match=r"\[SCOPE003\] metric 'auc'"):
        model.compile(optimizer="adam", loss="mse", metrics=[keras.metrics.AUC(name="auc")])


def test_compile_outside_the_scope_creates_named_objects_under_the_model_strategy():
    strategy = mirrored_strategy()
    with strategy.scope():
        model = safe_model()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = np.ones((8, 3), "float32")
    history = model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert scope_findings(model) == []


def test_fit_refuses_a_model_whose_optimizer_moved_outside_the_scope():
    strategy = mirrored_strategy()
    with strategy.scope():
        model = safe_model()
        model.compile(optimizer="sgd", loss="mse")
    model.optimizer = keras.optimizers.SGD(name="sgd")
    x = np.ones((8, 3), "float32")
    with pytest.raises(keras_safe_dist.ScopeError, match=r"SafeDistributedModel.fit\(\) found .*\n- \[SCOPE002\] optimizer 'sgd'"):
        model.fit(x, x[:, :1], verbose=0)


def one_device(device="/cpu:0"):
    return tf.distribute.OneDeviceStrategy(device)


@pytest.mark.parametrize("cls", [keras.Model, SafeDistributedModel], ids=["stock", "safe"])
def test_one_device_strategy_compiles_fits_and_audits_without_findings(cls):
    with one_device().scope():
        inputs = keras.Input((3,))
        model = cls(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    assert keras_safe_dist.audit(model).summary() == "pre-flight audit: 0 errors, 0 warnings, 0 info"
    x = np.ones((8, 3), "float32")
    history = model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    # After fit: optimizer slots and metric state, all plain, all accepted.
    findings, variables = aggregation_findings(model)
    assert len(variables) == 12 and {v.container for v in variables} == {"plain"}
    assert findings == [] and scope_findings(model) == []
    assert keras_safe_dist.audit(model).summary() == "pre-flight audit: 0 errors, 0 warnings, 0 info"


def test_one_device_strategy_still_flags_an_optimizer_of_another_strategy():
    with one_device().scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert scope_findings(model, optimizer=keras.optimizers.SGD()) == []  # plain: right
    with mirrored_strategy().scope():
        optimizer = keras.optimizers.SGD(name="mirrored_sgd")
    (finding,) = scope_findings(model, optimizer=optimizer)
    assert (finding.code, finding.subject) == ("SCOPE002", "optimizer 'mirrored_sgd'")
    assert finding.message.startswith(
        "2 of 2 variables belong to another MirroredStrategy with 2 replicas, "
        "not to the OneDeviceStrategy with 1 replica that trains it"
    )


def test_creation_watch_reports_held_variables_once_per_name():
    watch = CreationWatch(mirrored_strategy())
    watch.start()
    try:
        kept = [keras.Variable(0.0, name="kept") for _ in range(2)]
        keras.optimizers.SGD()  # dropped at once, like the one Keras's saving builds
        with mirrored_strategy().scope():
            kept.append(keras.Variable(0.0, name="in_scope"))
    finally:
        watch.stop()
    (finding,) = watch.findings()
    assert (finding.code, finding.subject) == ("SCOPE005", "variable 'kept'")
    assert "by test_audits.py:" in finding.message
    assert finding.message.endswith(
        "(2 variables of this name): it is a plain variable on one device, not mirrored across replicas."
    )


def test_creation_watch_under_one_device_accepts_plain_variables_only():
    watch = CreationWatch(one_device())
    watch.start()
    try:
        kept = [keras.Variable(0.0, name="plain")]
        with mirrored_strategy().scope():
            kept.append(keras.Variable(0.0, name="mirrored"))
    finally:
        watch.stop()
    (finding,) = watch.findings()
    assert finding.subject == "variable 'mirrored'"
    assert finding.message.endswith(": it belongs to another MirroredStrategy with 2 replicas.")


STRATEGIES = {
    "mirrored": mirrored_strategy,
    "one_device": one_device,
    "other_one_device": lambda: one_device("/cpu:1"),
}


@pytest.mark.parametrize(
    "built, entered, names",
    [
        ("mirrored", "one_device", ("OneDeviceStrategy with 1 replica", "MirroredStrategy with 2 replicas")),
        ("one_device", "mirrored", ("MirroredStrategy with 2 replicas", "OneDeviceStrategy with 1 replica")),
        ("one_device", "other_one_device", ("OneDeviceStrategy with 1 replica", "OneDeviceStrategy with 1 replica")),
    ],
)
def test_fit_inside_another_strategy_scope_raises_scope_error_naming_both(built, entered, names):
    built, entered = STRATEGIES[built](), STRATEGIES[entered]()
    x = np.ones((8, 3), "float32")
    models = {}
    for cls in (keras.Model, SafeDistributedModel):
        with built.scope():
            inputs = keras.Input((3,))
            models[cls] = cls(inputs, keras.layers.Dense(1)(inputs), name="built_under_a")
            models[cls].compile(optimizer="sgd", loss="mse")
    with entered.scope():
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            models[keras.Model].fit(x, x[:, :1], verbose=0)  # stock
        with pytest.raises(keras_safe_dist.ScopeError) as raised:
            models[SafeDistributedModel].fit(x, x[:, :1], verbose=0)
    message = str(raised.value)
    assert message.startswith(
        "SafeDistributedModel.fit() was called inside the scope of another strategy:\n"
        "- [SCOPE006] model 'built_under_a': SafeDistributedModel.fit() was called inside "
        f"`with strategy.scope():` of another strategy, a {names[0]}, but the model "
        f"belongs to the {names[1]} that built it"
    )
    assert message.endswith(
        "Fix: Call SafeDistributedModel.fit() outside that `with strategy.scope():` block, "
        f"or inside the scope of the {names[1]} (`with model.distribute_strategy.scope():`)."
    )
    assert [f.code for f in raised.value.findings] == ["SCOPE006"]
    with tf.distribute.get_strategy().scope():  # the default strategy's scope is no scope
        assert current_scope_findings("fit()", models[SafeDistributedModel]) == []


def test_compile_inside_another_strategy_scope_raises_scope006():
    with one_device().scope():
        model = safe_model()
    with mirrored_strategy().scope():
        with pytest.raises(keras_safe_dist.ScopeError, match=r"^SafeDistributedModel.compile\(\) was called inside the scope of another strategy:\n- \[SCOPE006\]"):
            model.compile(optimizer="sgd", loss="mse")


def stock_sequential(strategy, optimizer, loss="mse", *layers):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), *layers, keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss=loss)
    return model


def test_audit_flags_a_stock_optimizer_that_clips_per_replica_with_the_size_and_the_fix():
    model = stock_sequential(mirrored_strategy(), keras.optimizers.Adam(global_clipnorm=1.0, name="adam"))
    report = keras_safe_dist.audit(model)
    finding = only(report.findings, "DIST001")
    assert (finding.severity, finding.subject) == ("error", "optimizer 'adam'")
    assert "global_clipnorm=1 clips each replica's gradient before the all-reduce under MirroredStrategy with 2 replicas" in finding.message
    assert "the update's gradient norm can reach 2 x 1 = 2" in finding.message
    assert "`SafeDistributedModel.from_model(model, global_clipnorm=1)`" in finding.fix


@pytest.mark.parametrize(
    "optimizer,code,text",
    [
        (lambda: keras.optimizers.SGD(clipnorm=0.5), "DIST001", "clipnorm=0.5"),
        (lambda: keras.optimizers.SGD(clipvalue=0.25), "DIST001", "each element of the update's gradient can reach 2 x 0.25 = 0.5"),
        (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(global_clipnorm=2.0)), "DIST001", "global_clipnorm=2"),
        (lambda: keras.optimizers.SGD(gradient_accumulation_steps=3), "DIST002", "gradient_accumulation_steps=3 under MirroredStrategy with 2 replicas: fit() crashes"),
    ],
    ids=["clipnorm", "clipvalue", "loss-scale-inner", "accumulation"],
)
def test_audit_flags_each_optimizer_option_a_stock_model_applies_per_replica(optimizer, code, text):
    with mirrored_strategy().scope():
        built = optimizer()
    report = keras_safe_dist.audit(stock_sequential(mirrored_strategy(), built))
    finding = only(report.findings, code)
    assert finding.severity == "error" and text in finding.message
    assert "SafeDistributedModel.from_model(model, " in finding.fix


@pytest.mark.parametrize(
    "loss,layers,cause",
    [
        (lambda: keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"), (), "reduction='mean_with_sample_weight' divides by each replica's own sample-weight total"),
        (lambda: "mse", (keras.layers.Masking(name="pad"),), "the mask of pad makes each replica divide by its own count of unmasked entries"),
    ],
    ids=["mean-with-sample-weight", "mask"],
)
def test_audit_warns_of_a_stock_loss_normalized_per_replica(loss, layers, cause):
    model = stock_sequential(mirrored_strategy(), "sgd", loss(), *layers)
    report = keras_safe_dist.audit(model)
    assert report.codes() == ("DIST003",)
    finding = report.findings[0]
    assert finding.severity == "warning" and finding.message.startswith(cause)


def test_stock_findings_stay_silent_on_one_device_and_on_a_safe_model():
    one_device = stock_sequential(strategy_for(1), keras.optimizers.Adam(global_clipnorm=1.0))
    assert keras_safe_dist.audit(one_device).codes() == ()
    with mirrored_strategy().scope():
        sequential = keras.Sequential([keras.Input((4,)), keras.layers.Masking(), keras.layers.Dense(1)])
        safe = SafeDistributedModel.from_model(sequential, global_clipnorm=1.0)
        safe.compile(optimizer="adam", loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    assert keras_safe_dist.audit(safe).codes() == ()


def test_audit_flags_a_stock_fit_under_multi_worker_mirrored_strategy(monkeypatch):
    from keras_safe_dist.audits import stock

    # A MultiWorkerMirroredStrategy needs worker processes; the check reads the type.
    monkeypatch.setattr(stock, "_multi_worker", lambda s: isinstance(s, tf.distribute.MirroredStrategy))
    report = keras_safe_dist.audit(stock_sequential(mirrored_strategy(), "sgd"))
    finding = only(report.findings, "DIST005")
    assert finding.severity == "error"
    assert "fit() fails building the model from the first distributed batch" in finding.message
