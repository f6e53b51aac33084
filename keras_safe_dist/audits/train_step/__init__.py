"""Auditing a custom training loop's stateless train step (`LOOP*` findings).

Keras's guides to custom loops (above all on JAX) write the step around
`model.stateless_call(...)` and `optimizer.stateless_apply(...)`, threading
the state through it. Its mistakes raise no error: a forward pass without
`training=True`, updated non-trainable or optimizer or metric variables that
are dropped, a batch or state not laid out as the distribution says.
`audit_train_step` runs the step a few times on a copy of the state and
reports them. The rules are in `_checks.py`; the fresh trace of a step
compiled before the audit in `_trace.py`; the JAX layout check in
`keras_safe_dist/backend/jax/train_step_layout.py`, imported on the JAX backend only.
"""

import keras

from keras_safe_dist.audits.train_step._checks import TrainingModeRecorder
from keras_safe_dist.audits.train_step._checks import state_findings
from keras_safe_dist.audits.train_step._state import ModelSnapshot
from keras_safe_dist.audits.train_step._state import TrainState
from keras_safe_dist.audits.train_step._state import describe
from keras_safe_dist.audits.train_step._state import host_values
from keras_safe_dist.audits.train_step._trace import trace_afresh
from keras_safe_dist.core import _validate
from keras_safe_dist.findings import AuditReport
from keras_safe_dist.report import writer

__all__ = ["audit_train_step"]

REPORT_NAME = "train_step"


def audit_train_step(
    train_step, model, optimizer, data, *, steps=3, metrics=None, log_dir=None
):
    """Runs a stateless train step a few times and reports its silent mistakes.

    The step follows Keras's custom-loop convention: `train_step(state, data)`
    returns `(loss or logs, state)`, with `state = (trainable_variables,
    non_trainable_variables, optimizer_variables)` as lists of values in the
    order of `model.trainable_variables`, `model.non_trainable_variables` and
    `optimizer.variables` (and a fourth list, the variables of `metrics`, when
    `metrics` is given). The audit builds that state from the model and the
    optimizer (building the optimizer on `model.trainable_variables` if it is
    not built), runs the step `steps` times on a copy of it, each step on the
    state the previous one returned, and reports:

    - `LOOP001`: a BatchNormalization or dropout/noise layer called with
      `training=False` (or without `training`);
    - `LOOP002`: BatchNormalization statistics or a dropout seed that come
      back unchanged: the updated non-trainable variables are not threaded;
    - `LOOP003`: optimizer variables (iterations, moments) or weights that
      come back unchanged;
    - `LOOP005`: a metric's count that comes back unchanged;
    - `LOOP004` (JAX, under a `keras.distribution` distribution over several
      devices): state or batch arrays not laid out as the distribution says.
      Not run on TensorFlow, whose distribution is `tf.distribute`.

    The step may be jitted (`jax.jit`, `tf.function`) or not; a jitted
    step's Python function is traced once more first (not run), so that a
    step already compiled for these shapes still shows its layers'
    `training` value. The model's,
    optimizer's and metrics' variables hold after the audit the values they
    held before, even if the step assigns to them.

    Args:
        train_step: the step, a callable `train_step(state, data)`.
        model: the built `keras.Model` the step trains.
        optimizer: the `keras.optimizers.Optimizer` the step applies.
        data: one batch, as the training loop passes it to the step; it is
            passed as it is at every step.
        steps: how many steps to run, an integer >= 2.
        metrics: the `keras.metrics.Metric`s whose variables the step
            threads as a fourth state element, or None for a state of three.
        log_dir: where to write the report (TensorBoard text under
            `audits/train_step`, counts per severity, `audit_train_step.json`);
            None writes nothing.

    Returns:
        An `AuditReport` named `"train_step"`, as `keras_safe_dist.audit()`
        returns.

    Raises:
        TypeError: when `train_step` is not callable, `model` not a
            `keras.Model`, `optimizer` not a Keras optimizer, `metrics` not a
            list of Keras metrics, or `log_dir` not a path.
        ValueError: when the model has no variables yet, `steps` is not an
            integer >= 2, or the step returns something else than the state
            described above (the message says what was expected and received).
        RuntimeError: when the step raises, naming the step, what it was
            given and the step at which it raised (the step's exception is
            the cause).
        OSError: when `log_dir` cannot be created or written.

    Example:

    ```python
    report = keras_safe_dist.audit_train_step(train_step, model, optimizer, (x, y))
    print(report.to_markdown())
    ```
    """
    metrics = _check_arguments(train_step, model, optimizer, metrics)
    steps = _validate.integer_at_least("steps", steps, 2)
    log_dir = _validate.optional_path("log_dir", log_dir)
    if log_dir is not None:
        _validate.writable_directory("audit_train_step()", "log_dir", log_dir)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    name = step_name(train_step)
    train_state = TrainState(model, optimizer, metrics)
    layout = _layout_module()
    distribution = layout.current_distribution() if layout else None
    recorder = TrainingModeRecorder(model)
    snapshot = ModelSnapshot(model, optimizer, metrics or ())
    state = train_state.initial()
    layout_findings = []
    if distribution is not None:
        layout_findings += layout.state_findings(distribution, train_state, state, "passed in")
        layout_findings += layout.batch_findings(distribution, data)
    history = []
    try:
        with recorder.active():
            trace_afresh(train_step, state, data)  # one compiled before would call no layer
            for step in range(1, steps + 1):
                before = host_values(state)
                result = _run(train_step, name, state, data, step, steps, train_state, layout_findings)
                _, state = train_state.checked(result, name)
                history.append((before, host_values(state)))
                if distribution is not None and not any(
                    f.subject.startswith("state") for f in layout_findings
                ):
                    layout_findings += layout.state_findings(
                        distribution, train_state, state, "returned"
                    )
    finally:
        snapshot.restore()
    findings = recorder.findings()
    findings += state_findings(train_state, history, recorder, optimizer, metrics)
    report = AuditReport(REPORT_NAME, findings + layout_findings)
    if log_dir is not None and (layout.is_chief() if layout else True):
        writer.write_report(
            log_dir, report, extra={"train_step": name, "steps": steps}, who="audit_train_step"
        )
    return report


def step_name(train_step):
    """The step's qualified name (through `jax.jit` and `tf.function`), quoted, else its repr."""
    function = train_step
    for _ in range(4):
        for attribute in ("__qualname__", "__name__"):
            name = getattr(function, attribute, None)
            if isinstance(name, str):
                return f"'{name}'"
        function = getattr(function, "__wrapped__", None) or getattr(
            function, "python_function", None
        )
        if function is None:
            break
    return repr(train_step)


def _run(train_step, name, state, data, step, steps, train_state, layout_findings):
    try:
        return train_step(state, data)
    except Exception as error:
        lists = ", ".join(
            f"{group} ({len(values)} arrays)" for group, values in zip(train_state.names, state)
        )
        hint = "".join(
            f" The {f.subject} may be why ({f.code}): {f.message}" for f in layout_findings
        )
        raise RuntimeError(
            f"audit_train_step(): the train step {name} raised {type(error).__name__} at "
            f"step {step} of {steps}: {error}. It was called as {name}(state, data) "
            f"with state = ({lists}) in the order of the model's and optimizer's "
            f"variables, and data = {describe(data)}. It must accept those and return "
            f"{train_state.expected()}.{hint}"
        ) from error


def _check_arguments(train_step, model, optimizer, metrics):
    if not callable(train_step):
        raise TypeError(
            "`train_step` must be a callable `train_step(state, data)` that returns "
            f"`(loss or logs, state)`. Received: train_step={train_step!r}"
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model. Received: model={model!r}"
        )
    if not model.built or not model.variables:
        raise ValueError(
            f"audit_train_step() needs a built model, but model '{model.name}' has no "
            "variables yet. Call model.build(input_shape) or run it on one batch first."
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a keras.optimizers.Optimizer, the one the step "
            f"applies with stateless_apply. Received: optimizer={optimizer!r}"
        )
    if metrics is None:
        return None
    if isinstance(metrics, keras.metrics.Metric):
        metrics = [metrics]
    if not isinstance(metrics, (list, tuple)) or not all(
        isinstance(m, keras.metrics.Metric) for m in metrics
    ):
        raise TypeError(
            "`metrics` must be None or a list of keras.metrics.Metric whose "
            f"variables are the state's fourth element. Received: metrics={metrics!r}"
        )
    return list(metrics)


def _layout_module():
    """The JAX layout check on the JAX backend (imported there only), else None."""
    if keras.backend.backend() != "jax":
        return None
    from keras_safe_dist.backend.jax import train_step_layout as _jax_layout

    return _jax_layout
