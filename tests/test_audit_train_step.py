"""audit_train_step on TensorFlow: a stateless train step's silent mistakes (LOOP*)."""

import json
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import keras_safe_dist
from keras_safe_dist.findings import CODES
from keras_safe_dist.report import read_log_dir

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import custom_loop_tf  # noqa: E402

BATCH = 16


def setup(seed=0):
    keras.utils.set_random_seed(seed)
    model = custom_loop_tf.build_model()
    optimizer = keras.optimizers.Adam(1e-2, name="adam")
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, custom_loop_tf.FEATURES)).astype("float32")
    y = rng.normal(size=(BATCH, 1)).astype("float32")
    return model, optimizer, (tf.constant(x), tf.constant(y))


def make_step(model, optimizer, training=True, returns=("trainable", "non_trainable", "optimizer"),
              metric=None, compiled=False):
    """A stateless step; `returns` names the state parts it returns updated (others as given)."""
    loss_fn = keras.losses.MeanSquaredError()
    kwargs = {} if training is None else {"training": training}

    def train_step(state, data):
        trainable, non_trainable, optimizer_variables = state[:3]
        x, y = data
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            y_pred, new_non_trainable = model.stateless_call(trainable, non_trainable, x, **kwargs)
            loss = loss_fn(y, y_pred)
        grads = tape.gradient(loss, trainable)
        new_trainable, new_optimizer = custom_loop_tf.stateless_apply(
            optimizer, model, optimizer_variables, grads, trainable
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

    return tf.function(train_step) if compiled else train_step


def weights(model, optimizer):
    return [np.array(v.value) for v in model.variables + optimizer.variables]


def test_guide_loop_audits_clean_trains_and_leaves_the_model_as_it_was():
    report, losses, model = custom_loop_tf.main(samples=64, batch_size=16, epochs=2)
    assert report.findings == ()
    assert report.summary() == "train_step audit: 0 errors, 0 warnings, 0 info"
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("training", [False, None], ids=["training_false", "no_training"])
def test_forward_pass_in_inference_mode_is_loop001_for_each_training_dependent_layer(
    compiled, training
):
    model, optimizer, data = setup()
    step = make_step(model, optimizer, training=training, compiled=compiled)
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data)
    assert report.codes() == ("LOOP001",)
    assert sorted(f.subject for f in report) == ["batch_norm", "dropout"]
    assert all("training=False" in f.message for f in report)


def test_a_tf_function_step_without_training_is_loop001_before_and_after_it_ran():
    model, optimizer, data = setup()
    optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer, training=None, compiled=True)
    before = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, optimizer.variables))
    step(state, data)  # the loop ran it: tf.function reuses its trace
    after = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    for report in (before, after):
        assert [(f.code, f.subject) for f in report] == [
            ("LOOP001", "batch_norm"), ("LOOP001", "dropout")
        ]
        assert report.findings[0].message.startswith(
            "the train step called BatchNormalization with training=False"
        )


def test_dropped_non_trainable_state_is_loop002_at_every_step():
    model, optimizer, data = setup()
    step = make_step(model, optimizer, returns=("trainable", "optimizer"))
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=2)
    assert report.codes() == ("LOOP002",)
    by_layer = {f.subject: f.message for f in report}
    assert sorted(by_layer) == ["batch_norm", "dropout"]
    assert "unchanged at steps 1, 2 of 2, although it ran in training mode" in by_layer["dropout"]
    assert "same dropout mask is drawn at every step" in by_layer["dropout"]
    assert "moving statistics never move" in by_layer["batch_norm"]


def test_dropped_optimizer_state_is_loop003_naming_the_optimizer():
    model, optimizer, data = setup()
    step = make_step(model, optimizer, returns=("trainable", "non_trainable"))
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data)
    assert [(f.code, f.subject) for f in report] == [("LOOP003", "optimizer 'adam'")]
    assert "unchanged at steps 1, 2, 3 of 3" in report.findings[0].message
    assert "restarts at every step" in report.findings[0].message


def test_weights_returned_as_given_are_loop003():
    model, optimizer, data = setup()
    step = make_step(model, optimizer, returns=("non_trainable", "optimizer"))
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data)
    assert [(f.code, f.subject) for f in report] == [("LOOP003", "trainable_variables")]
    assert "although the optimizer ran" in report.findings[0].message


def test_metric_state_threaded_is_silent_and_dropped_is_loop005():
    model, optimizer, data = setup()
    metric = keras.metrics.MeanAbsoluteError()
    threaded = make_step(
        model, optimizer, metric=metric,
        returns=("trainable", "non_trainable", "optimizer", "metric"),
    )
    report = keras_safe_dist.audit_train_step(threaded, model, optimizer, data, metrics=[metric])
    assert report.findings == ()
    dropped = make_step(model, optimizer, metric=metric)
    report = keras_safe_dist.audit_train_step(dropped, model, optimizer, data, metrics=[metric])
    assert [(f.code, f.subject) for f in report] == [("LOOP005", "metric 'mean_absolute_error'")]
    assert np.array(metric.variables[1].value) == 0.0  # the metric itself untouched


def test_model_and_optimizer_hold_their_values_after_a_step_that_assigns_them():
    model, optimizer, data = setup()
    optimizer.build(model.trainable_variables)
    before = weights(model, optimizer)
    # The TensorFlow step assigns the state into the variables to apply the optimizer.
    step = make_step(model, optimizer)
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data)
    assert report.findings == ()
    after = weights(model, optimizer)
    assert all(np.array_equal(b, a) for b, a in zip(before, after))


def test_unbuilt_optimizer_is_built_on_the_trainable_variables():
    model, optimizer, data = setup()
    assert not optimizer.built
    keras_safe_dist.audit_train_step(make_step(model, optimizer), model, optimizer, data, steps=2)
    assert optimizer.built
    assert int(np.array(optimizer.iterations.value)) == 0
    assert len(optimizer.variables) == 2 + 2 * len(model.trainable_variables)


def test_a_step_that_raises_names_the_step_what_it_got_and_chains_the_error():
    model, optimizer, data = setup()

    def broken_step(state, data):
        raise KeyError("no such layer")

    with pytest.raises(RuntimeError) as caught:
        keras_safe_dist.audit_train_step(broken_step, model, optimizer, data)
    message = str(caught.value)
    assert "train step 'test_a_step_that_raises_names_the_step_what_it_got_and_chains_the_error." \
        "<locals>.broken_step' raised KeyError at step 1 of 3" in message
    assert "trainable_variables (6 arrays), non_trainable_variables (3 arrays), " \
        "optimizer_variables (14 arrays)" in message
    assert "data = a tuple of 2: (EagerTensor of shape (16, 8), EagerTensor of shape (16, 1))" in message
    assert isinstance(caught.value.__cause__, KeyError)


def test_bad_arguments_say_what_was_expected_and_received():
    model, optimizer, data = setup()
    step = make_step(model, optimizer)
    with pytest.raises(TypeError, match="`train_step` must be a callable .* Received: train_step=3"):
        keras_safe_dist.audit_train_step(3, model, optimizer, data)
    with pytest.raises(TypeError, match="`model` must be a keras.Model. Received: model='m'"):
        keras_safe_dist.audit_train_step(step, "m", optimizer, data)
    with pytest.raises(TypeError, match="`optimizer` must be a keras.optimizers.Optimizer"):
        keras_safe_dist.audit_train_step(step, model, "adam", data)
    with pytest.raises(ValueError, match=r"`steps` must be an integer >= 2. Received: steps=1"):
        keras_safe_dist.audit_train_step(step, model, optimizer, data, steps=1)
    with pytest.raises(TypeError, match="`metrics` must be None or a list of keras.metrics.Metric"):
        keras_safe_dist.audit_train_step(step, model, optimizer, data, metrics=["mae"])
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="needs a built model, .* Call model.build"):
        keras_safe_dist.audit_train_step(step, unbuilt, optimizer, data)


@pytest.mark.parametrize(
    "returned, expected",
    [
        (lambda state: 1.0, r"must return a pair `\(loss or logs, state\)`. Received: a float"),
        (lambda state: (1.0, state[:2]), r"must return a state of 3 lists .* Received as state: a tuple of 2"),
        (lambda state: (1.0, (state[0][:-1], state[1], state[2])),
         r"returned a state\[0\] \(trainable_variables\) that is not a list of 6 values"),
        (lambda state: (1.0, (state[0][1:] + state[0][:1], state[1], state[2])),
         r"returned in state\[0\] \(trainable_variables\) a value of shape \(16,\) where "
         r"hidden/kernel has shape \(8, 16\)"),
    ],
    ids=["not_a_pair", "two_lists", "short_list", "wrong_order"],
)
def test_a_step_returning_the_wrong_structure_says_what_to_return(returned, expected):
    model, optimizer, data = setup()

    def step(state, data):
        return returned(state)

    with pytest.raises(ValueError, match=expected) as caught:
        keras_safe_dist.audit_train_step(step, model, optimizer, data)
    assert "Return `(loss or logs, state)` with `state = (trainable_variables (6 values), " \
        "non_trainable_variables (3 values), optimizer_variables (14 values))`" in str(caught.value)


def test_findings_go_to_markdown_json_and_tensorboard_text(tmp_path):
    model, optimizer, data = setup()
    step = make_step(model, optimizer, training=False)
    report = keras_safe_dist.audit_train_step(step, model, optimizer, data, log_dir=tmp_path)
    markdown = report.to_markdown()
    assert markdown.startswith("**train_step audit: 2 errors, 0 warnings, 0 info (LOOP001)**")
    assert "| LOOP001 | error | dropout |" in markdown
    written = json.loads((tmp_path / "audit_train_step.json").read_text())
    assert [f["code"] for f in written["findings"]] == ["LOOP001", "LOOP001"]
    assert written["train_step"].endswith("make_step.<locals>.train_step'")
    events = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("audits/train_step")
    assert "LOOP001" in tf.make_ndarray(text.tensor_proto).item().decode()
    assert read_log_dir(tmp_path).audits[0].codes() == ("LOOP001",)


def test_loop_codes_are_registered_and_documented():
    documented = (ROOT / "docs" / "audits.md").read_text()
    loops = [code for code in CODES if code.startswith("LOOP")]
    assert loops == ["LOOP001", "LOOP002", "LOOP003", "LOOP004", "LOOP005"]
    for code in loops:
        assert f"| {code} | {CODES[code].severity} |" in documented
        assert f"`{code}`" in (ROOT / "docs" / "custom_loops.md").read_text()


def test_the_loops_in_the_docs_are_the_examples_code():
    doc = (ROOT / "docs" / "custom_loops.md").read_text()
    blocks = re.findall(r"<!-- same code as (examples/\S+) -->\n```python\n(.*?)```", doc, re.S)
    assert sorted({path for path, _ in blocks}) == [
        "examples/custom_loop_jax.py", "examples/custom_loop_tf.py"
    ]
    assert len(blocks) == 7
    for path, code in blocks:
        assert code in (ROOT / path).read_text(), f"docs/custom_loops.md drifted from {path}"


def test_the_layout_check_is_not_run_and_jax_not_needed_on_tensorflow():
    assert "keras_safe_dist.backend.jax.train_step_layout" not in sys.modules
    # In a process where jax cannot be imported, the package and the audit work.
    script = (
        "import sys; sys.modules['jax'] = None\n"
        "import custom_loop_tf\n"
        "report, losses, _ = custom_loop_tf.main(samples=32, batch_size=16, epochs=1)\n"
        "assert report.findings == (), report\n"
        "assert 'keras_safe_dist.backend.jax.train_step_layout' not in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'examples'}", "TF_CPP_MIN_LOG_LEVEL": "3",
             "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "train_step audit: 0 errors, 0 warnings, 0 info"
    assert done.stdout.splitlines()[-1] == "ok"
