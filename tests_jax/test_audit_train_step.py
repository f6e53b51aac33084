"""audit_train_step on JAX: a stateless train step's silent mistakes (LOOP*), DataParallel too."""

import pathlib
import re
import sys

import jax
import keras
import numpy as np
import pytest

import keras_safe_dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import custom_loop_jax  # noqa: E402

BATCH = 16
ALL = ("trainable", "non_trainable", "optimizer", "metric")


def setup(seed=0):
    """The example's model and an Adam, built in the current distribution's scope, and a batch."""
    keras.utils.set_random_seed(seed)
    model = custom_loop_jax.build_model()
    optimizer = keras.optimizers.Adam(1e-2, name="adam")
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, custom_loop_jax.FEATURES)).astype("float32")
    y = rng.normal(size=(BATCH, 1)).astype("float32")
    distribution = keras.distribution.distribution()
    data = custom_loop_jax.shard((x, y), distribution) if distribution else (x, y)
    return model, optimizer, data


def make_step(model, optimizer, training=True, returns=ALL, metric=None, jit=True,
              from_model=()):
    """The guide's step; `returns` names the state parts it returns updated (others as
    given); `from_model` the parts it reads from the model instead of the state."""
    loss_fn = keras.losses.MeanSquaredError()
    kwargs = {} if training is None else {"training": training}

    def compute_loss_and_updates(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, **kwargs)
        return loss_fn(y, y_pred), (non_trainable, y_pred)

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    def train_step(state, data):
        trainable, non_trainable, optimizer_variables = state[:3]
        if "non_trainable" in from_model:
            non_trainable = [v.value for v in model.non_trainable_variables]
        if "optimizer" in from_model:
            optimizer_variables = [v.value for v in optimizer.variables]
        x, y = data
        (loss, (new_non_trainable, y_pred)), grads = grad_fn(trainable, non_trainable, x, y)
        new_trainable, new_optimizer = optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        new_state = (
            new_trainable if "trainable" in returns else trainable,
            new_non_trainable if "non_trainable" in returns else non_trainable,
            new_optimizer if "optimizer" in returns else optimizer_variables,
        )
        if metric is not None:
            new_metric = metric.stateless_update_state(state[3], y, y_pred)
            new_state += (new_metric if "metric" in returns else state[3],)
        return loss, new_state

    return jax.jit(train_step) if jit else train_step


def values(model, optimizer):
    return [np.asarray(v.value) for v in model.variables + optimizer.variables]


def test_guide_loop_with_data_parallel_audits_clean_and_trains(devices):
    report, losses, model = custom_loop_jax.main(
        samples=64, batch_size=16, epochs=2, devices=jax.devices()[:devices]
    )
    assert report.findings == ()
    assert losses[-1] < losses[0]
    kernel = model.get_layer("hidden").kernel.value
    assert len(kernel.sharding.device_set) == devices  # replicated over the distribution


@pytest.mark.parametrize(
    "jit, training", [(True, False), (False, None)], ids=["jit_training_false", "eager_no_training"]
)
def test_forward_pass_in_inference_mode_is_loop001_for_each_training_dependent_layer(
    devices, jit, training
):
    model, optimizer, data = setup()
    step = make_step(model, optimizer, training=training, jit=jit)
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data)
    assert report.codes() == ("LOOP001",)
    assert sorted(f.subject for f in report) == ["batch_norm", "dropout"]


def run_once(step, model, optimizer, data):
    """Runs `step` as the loop does, so its trace for these shapes is cached."""
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    return step(state, data)


def test_a_jitted_step_without_training_is_loop001_before_and_after_it_ran(devices):
    model, optimizer, data = setup()
    step = make_step(model, optimizer, training=None)
    before = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    run_once(step, model, optimizer, data)  # the loop ran it: jax.jit reuses its trace
    after = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    for report in (before, after):
        assert [(f.code, f.subject) for f in report] == [
            ("LOOP001", "batch_norm"), ("LOOP001", "dropout")
        ]
        assert report.findings[1].message.startswith(
            "the train step called Dropout with training=False (or without `training`"
        )


def test_a_step_calling_an_already_compiled_forward_pass_leads_loop002_with_both_causes():
    model, optimizer, data = setup()
    inner = make_step(model, optimizer, training=None)
    run_once(inner, model, optimizer, data)

    def step(state, data):  # not jitted itself: only `inner`'s cached trace runs
        return inner(state, data)

    report = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    assert report.codes() == ("LOOP002",)
    dropout = {f.subject: f for f in report}["dropout"]
    assert dropout.message.startswith(
        "Dropout: its seed generator state came back from the train step unchanged at steps "
        "1, 2 of 2: either the step calls it without `training=True` or the step returns the "
        "non_trainable_variables it was given"
    )
    assert "a function the step calls was compiled before the audit" in dropout.message
    assert dropout.fix.startswith("Pass `training=True` to `model.stateless_call(...)`; if it is")


def test_dropped_non_trainable_state_is_loop002_for_statistics_and_seed(devices):
    model, optimizer, data = setup()
    step = make_step(model, optimizer, returns=("trainable", "optimizer"))
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data)
    assert report.codes() == ("LOOP002",)
    by_layer = {f.subject: f.message for f in report}
    assert sorted(by_layer) == ["batch_norm", "dropout"]
    assert "unchanged at steps 1, 2, 3 of 3" in by_layer["dropout"]
    assert "returns the non_trainable_variables it was given" in by_layer["dropout"]


def test_a_step_that_reads_the_model_instead_of_the_state_restarts_every_step(devices):
    model, optimizer, data = setup()
    step = make_step(model, optimizer, from_model=("non_trainable", "optimizer"))
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data)
    findings = {(f.code, f.subject): f.message for f in report}
    # The seed and the optimizer restart from the model's values: unchanged from step 2.
    # BatchNormalization's statistics still differ (the weights feeding it moved).
    assert sorted(findings) == [("LOOP002", "dropout"), ("LOOP003", "optimizer 'adam'")]
    for message in findings.values():
        assert "unchanged at steps 2, 3 of 3" in message
        assert "starts from the model's own variables at every step" in message


def test_dropped_optimizer_state_or_weights_are_loop003(devices):
    model, optimizer, data = setup()
    step = make_step(model, optimizer, returns=("trainable", "non_trainable"))
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    assert [(f.code, f.subject) for f in report] == [("LOOP003", "optimizer 'adam'")]
    step = make_step(model, optimizer, returns=("non_trainable", "optimizer"))
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    assert [(f.code, f.subject) for f in report] == [("LOOP003", "trainable_variables")]


def test_metric_state_threaded_is_silent_and_dropped_is_loop005(devices):
    model, optimizer, data = setup()
    metric = keras.metrics.MeanAbsoluteError(name="mae")
    step = make_step(model, optimizer, metric=metric)
    assert keras_safe_dist.audit_train_step(step, model, optimizer, data, metrics=[metric]).findings == ()
    step = make_step(model, optimizer, metric=metric, returns=ALL[:3])
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data, metrics=[metric])
    assert [(f.code, f.subject) for f in report] == [("LOOP005", "metric 'mae'")]


def test_model_and_optimizer_hold_their_values_after_the_audit(devices):
    model, optimizer, data = setup()
    before = values(model, optimizer)
    arrays = {id(v): v.value for v in model.variables + optimizer.variables}

    def assigning_step(state, data):
        loss, state = make_step(model, optimizer, jit=False)(state, data)
        for variable, value in zip(model.trainable_variables, state[0]):
            variable.assign(value)  # a step that also writes the model
        return loss, state

    keras_safe_dist.audit_train_step(assigning_step, model, optimizer, data)
    after = values(model, optimizer)
    assert all(np.array_equal(b, a) for b, a in zip(before, after))
    # Untouched variables keep the very arrays (and layouts) they had.
    untouched = model.non_trainable_variables + optimizer.variables
    assert all(v.value is arrays[id(v)] for v in untouched)


def test_a_numpy_batch_under_data_parallel_is_loop004(devices):
    model, optimizer, (x, y) = setup()
    batch = (np.asarray(x), np.asarray(y))
    report = keras_safe_dist.audit_train_step(make_step(model, optimizer), model, optimizer, batch)
    if devices == 1:
        assert report.findings == ()  # one device: nothing to split
        return
    assert [(f.code, f.severity, f.subject) for f in report] == [("LOOP004", "warning", "batch")]
    message = report.findings[0].message
    assert message.startswith("2 of 2 batch arrays are not split along the batch dimension "
                              "as DataParallel over 2 devices says")
    assert "array 0 of shape (16, 8) is a numpy ndarray, on no device" in message


def test_a_batch_committed_to_one_device_fails_with_the_layout_named():
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    with distribution.scope():
        model, optimizer, (x, y) = setup()
        one_device = tuple(jax.device_put(np.asarray(a), jax.devices()[0]) for a in (x, y))
        with pytest.raises(RuntimeError) as caught:
            keras_safe_dist.audit_train_step(make_step(model, optimizer), model, optimizer, one_device)
    message = str(caught.value)
    assert "the train step 'make_step.<locals>.train_step' raised ValueError at step 1 of 3" in message
    assert "The batch may be why (LOOP004): 2 of 2 batch arrays are not split" in message
    assert "array 0 of shape (16, 8) is on cpu:0, not P('batch', None) over 2 devices" in message


def test_a_model_built_outside_the_distribution_is_loop004_for_the_state():
    model, optimizer, (x, y) = setup()  # no distribution: one device
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    with distribution.scope():
        report = keras_safe_dist.audit_train_step(make_step(model, optimizer), model, optimizer, (x, y))
    findings = {f.subject: f for f in report}
    assert sorted(findings) == ["batch", "state passed in"]
    state = findings["state passed in"]
    assert state.code == "LOOP004"
    assert state.message.startswith("23 of 23 state values passed in are not laid out as "
                                    "DataParallel over 2 devices lays out their variables")
    assert "created outside the distribution's scope" in state.message


def test_state_returned_as_host_arrays_is_loop004_for_the_returned_state():
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    with distribution.scope():
        model, optimizer, data = setup()
        inner = make_step(model, optimizer)

        def host_step(state, data):
            loss, state = inner(state, data)
            return loss, tuple([np.asarray(v) for v in values] for values in state)

        report = keras_safe_dist.audit_train_step(host_step, model, optimizer, data, steps=2)
    assert [(f.code, f.subject) for f in report] == [("LOOP004", "state returned")]
    message = report.findings[0].message
    assert message.startswith("23 of 23 state values returned are not laid out")
    assert "hidden/kernel is a numpy ndarray, on no device" in message
    assert "the train step moves them" in message


def test_a_step_that_raises_names_the_step_and_chains_the_error(devices):
    model, optimizer, data = setup()

    @jax.jit
    def shape_error_step(state, data):
        return state[0][0] @ state[0][0], state

    with pytest.raises(RuntimeError) as caught:
        keras_safe_dist.audit_train_step(shape_error_step, model, optimizer, data)
    message = str(caught.value)
    assert "the train step 'test_a_step_that_raises_names_the_step_and_chains_the_error." \
        "<locals>.shape_error_step' raised TypeError at step 1 of 3" in message
    assert re.search(r"data = a tuple of 2: \(\w+ of shape \(16, 8\), \w+ of shape \(16, 1\)\)", message)
    assert isinstance(caught.value.__cause__, TypeError)


def test_bad_arguments_and_results_say_what_was_expected(devices):
    model, optimizer, data = setup()
    with pytest.raises(TypeError, match="`optimizer` must be a keras.optimizers.Optimizer"):
        keras_safe_dist.audit_train_step(make_step(model, optimizer), model, object(), data)
    with pytest.raises(ValueError, match=r"must return a state of 4 lists \(trainable_variables, "
                       r"non_trainable_variables, optimizer_variables, metrics_variables\)"):
        keras_safe_dist.audit_train_step(
            make_step(model, optimizer), model, optimizer, data, metrics=[keras.metrics.Mean()]
        )
