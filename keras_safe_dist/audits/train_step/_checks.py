"""The rules of the train-step audit (`LOOP001` to `LOOP003`, `LOOP005`), backend-neutral.

Each rule compares the state a step was given with the state it returned,
step by step (the audit threads the returned state into the next step). A
correct step, in training mode, changes at every step: the moving statistics
of each BatchNormalization, the seed state of each Dropout, the optimizer's
`iterations`, the weights, a metric's `count`. A value that comes back
unchanged means the step returned what it was given; one that comes back
unchanged only from the second step means the step ignores the state it is
given and starts from the model's own variables every time.
"""

import contextlib
import inspect

import keras
import numpy as np

from keras_safe_dist.audits.training_mode import training_dependent_layers
from keras_safe_dist.findings import Finding

__all__ = ["TrainingModeRecorder", "state_findings"]

_NOT_THREADED = "the step returns the {what} it was given, not the updated ones"
_RESTARTS = (
    "the step ignores the {what} passed in and starts from the model's own "
    "variables at every step (it came back updated at step 1 only)"
)


class TrainingModeRecorder:
    """Records the `training` value each training-dependent layer's `call` receives.

    While active, the `call` of each layer that `training_dependent_layers`
    lists is wrapped on the instance; the wrapper records the value and calls
    the original. A jitted or `tf.function` step records while it is traced
    (the audit traces a compiled step afresh, `_trace.py`); a function the
    step calls that was compiled before the audit records nothing
    (`observed` stays empty for its layers).

    Args:
        model: the audited `keras.Model`.
    """

    def __init__(self, model):
        self.layers = training_dependent_layers(model)
        self.observed = {id(layer): set() for layer, _, _ in self.layers}

    @contextlib.contextmanager
    def active(self):
        wrapped = []
        try:
            for layer, _, _ in self.layers:
                if "call" in vars(layer):
                    continue  # already wrapped on the instance: leave it alone
                object.__setattr__(layer, "call", self._recording(layer, layer.call))
                wrapped.append(layer)
            yield self
        finally:
            for layer in wrapped:
                object.__delattr__(layer, "call")

    def _recording(self, layer, call):
        signature = inspect.signature(call)
        seen = self.observed[id(layer)]

        def recording_call(*args, **kwargs):
            try:
                training = signature.bind_partial(*args, **kwargs).arguments.get("training")
            except TypeError:
                training = "unknown"
            if training is True:
                seen.add("training")
            elif training is None or training is False:
                seen.add("inference")
            else:  # a tensor: decided in the graph
                seen.add("unknown")
            return call(*args, **kwargs)

        return recording_call

    def findings(self):
        """`LOOP001` for each layer the step called in inference mode."""
        return [
            _inference_mode(layer, kind)
            for layer, kind, _ in self.layers
            if "inference" in self.observed[id(layer)]
        ]

    def in_inference(self, layer):
        return "inference" in self.observed[id(layer)]

    def unobserved(self, layer):
        return not self.observed[id(layer)]


def state_findings(train_state, history, recorder, optimizer, metrics):
    """`LOOP002`, `LOOP003` and `LOOP005` from the states around each step.

    Args:
        train_state: the `TrainState`.
        history: `[(before, after)]` per step, each a tuple of lists of
            NumPy arrays.
        recorder: the `TrainingModeRecorder` of the steps.
        optimizer: the audited optimizer.
        metrics: the metrics of the fourth element, or None.

    Returns:
        A list of findings.
    """
    findings = []
    groups = dict(zip(train_state.names, range(len(train_state.names))))
    for layer, kind, state in recorder.layers:
        if recorder.in_inference(layer):
            continue  # LOOP001 says why it did not change
        positions = [train_state.index("non_trainable_variables", v) for v in state]
        if None in positions:
            continue
        steps = _unchanged_steps(history, groups["non_trainable_variables"], positions)
        if steps:
            findings.append(_non_trainable(layer, kind, steps, len(history), recorder))
    optimizer_group = groups["optimizer_variables"]
    iterations = train_state.index("optimizer_variables", optimizer.iterations)
    optimizer_steps = [
        step
        for step in _unchanged_steps(
            history,
            optimizer_group,
            [iterations] if iterations is not None else range(len(optimizer.variables)),
        )
        if not _skipped_update(history[step - 1], optimizer_group, train_state, optimizer)
    ]
    if optimizer.variables and optimizer_steps:
        findings.append(_optimizer_state(optimizer, optimizer_steps, len(history)))
    weights_steps = [
        step
        for step in _unchanged_steps(
            history, groups["trainable_variables"], range(len(train_state.groups[0][1]))
        )
        if not _skipped_update(history[step - 1], optimizer_group, train_state, optimizer)
    ]
    if train_state.groups[0][1] and weights_steps and _learning_rate(optimizer) != 0:
        findings.append(_weights(weights_steps, len(history)))
    if metrics is not None:
        for metric in metrics:
            counters = [
                train_state.index("metrics_variables", v)
                for v in metric.variables
                if v.name == "count"
            ]
            if not counters:
                continue  # a metric without a count may legitimately stay put
            steps = _unchanged_steps(history, groups["metrics_variables"], counters)
            if steps:
                findings.append(_metric_state(metric, steps, len(history)))
    return findings


def _unchanged_steps(history, group, positions):
    """The steps (from 1) after which every value at `positions` of `group` was unchanged."""
    positions = list(positions)
    if not positions:
        return []
    return [
        step
        for step, (before, after) in enumerate(history, start=1)
        if all(np.array_equal(before[group][p], after[group][p]) for p in positions)
    ]


def _skipped_update(record, group, train_state, optimizer):
    """Whether the optimizer skipped this update on purpose.

    A `LossScaleOptimizer` skips the update of a step with non-finite
    gradients: its `iterations` stay, its `dynamic_scale` is lowered.
    """
    scale = getattr(optimizer, "dynamic_scale", None)
    position = train_state.index("optimizer_variables", scale) if scale is not None else None
    if position is None:
        return False
    before, after = record
    return not np.array_equal(before[group][position], after[group][position])


def _learning_rate(optimizer):
    try:
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except (TypeError, ValueError):
        return None


def _how(steps, what):
    """Which mistake the unchanged steps point to."""
    return (_NOT_THREADED if 1 in steps else _RESTARTS).format(what=what)


def _at(steps, total):
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} of {total}"


def _name(layer):
    return getattr(layer, "path", None) or layer.name


def _inference_mode(layer, kind):
    effect = (
        "it normalized with its moving statistics and never updated them"
        if kind == "batch norm"
        else "it applied no noise"
    )
    return Finding.of(
        "LOOP001",
        _name(layer),
        f"the train step called {type(layer).__name__} with training=False (or "
        f"without `training`, which means False): {effect}.",
        "Pass `training=True` to `model.stateless_call(...)` in the train step "
        "(and, in a subclassed model, pass `training` on to the layers in `call`).",
    )


def _non_trainable(layer, kind, steps, total, recorder):
    what = (
        "its moving mean and variance" if kind == "batch norm" else "its seed generator state"
    )
    effect = (
        "the moving statistics never move"
        if kind == "batch norm"
        else "the same dropout mask is drawn at every step"
    )
    fix = (
        "the non_trainable_variables that `model.stateless_call` returns "
        "(the aux output of `value_and_grad`), and pass the state's "
        "non_trainable_variables to `stateless_call`."
    )
    if recorder.unobserved(layer) and 1 in steps:
        # Its call was compiled before the audit: inference mode is as likely.
        return Finding.of(
            "LOOP002",
            _name(layer),
            f"{type(layer).__name__}: {what} came back from the train step unchanged "
            f"at {_at(steps, total)}: either the step calls it without `training=True` "
            f"or {_how(steps, 'non_trainable_variables')}, so {effect}. (Its training "
            "mode was not seen: a function the step calls was compiled before the audit.)",
            "Pass `training=True` to `model.stateless_call(...)`; if it is passed, return "
            + fix,
        )
    return Finding.of(
        "LOOP002",
        _name(layer),
        f"{type(layer).__name__}: {what} came back from the train step unchanged "
        f"at {_at(steps, total)}, although it ran in training mode: "
        f"{_how(steps, 'non_trainable_variables')}, so {effect}.",
        "Return " + fix,
    )


def _optimizer_state(optimizer, steps, total):
    return Finding.of(
        "LOOP003",
        f"optimizer '{optimizer.name}'",
        f"the optimizer variables (iterations, moments) came back from the train step "
        f"unchanged at {_at(steps, total)}: "
        f"{_how(steps, 'optimizer_variables')}, so the optimizer restarts at every "
        "step (Adam's moments and bias correction start again from zero).",
        "Return the optimizer_variables that `optimizer.stateless_apply` returns, and "
        "pass the state's optimizer_variables to it.",
    )


def _weights(steps, total):
    return Finding.of(
        "LOOP003",
        "trainable_variables",
        f"every trainable value came back from the train step unchanged at "
        f"{_at(steps, total)} although the optimizer ran: "
        f"{_how(steps, 'trainable_variables')} (or every gradient is zero: a loss "
        "that does not depend on the weights).",
        "Return the trainable_variables that `optimizer.stateless_apply` returns, "
        "and pass the state's trainable_variables to `stateless_call` and "
        "`stateless_apply`.",
    )


def _metric_state(metric, steps, total):
    return Finding.of(
        "LOOP005",
        f"metric '{metric.name}'",
        f"its count came back from the train step unchanged at {_at(steps, total)}: "
        f"{_how(steps, 'metrics_variables')}, so the metric reports the first "
        "batch (or nothing).",
        "Return the metric variables that `metric.stateless_update_state` returns, "
        "and pass the state's metrics_variables to it.",
    )
