"""`JAX002`: variables created before the `keras.distribution` distribution was set.

A `keras.Variable` takes its layout from the distribution in effect when it
is created. A model (or optimizer, or metric) created before
`keras.distribution.set_distribution(...)` keeps its variables on one
device, and Keras's jitted step then fails on the mix ("Received
incompatible devices for jitted computation"). `SafeDistributedModel` lays
such variables out on the distribution once, before its first step, and
warns; `keras_safe_dist.audit()` reports them as `JAX002`. The check is
LOOP004's (`train_step_layout`), on the variables instead of a custom
loop's state. Only imported on the JAX backend.
"""

import jax
import keras

from keras_safe_dist import _warnings
from keras_safe_dist.backend.jax import _compat as _jax_compat
from keras_safe_dist.backend.jax.train_step_layout import current_distribution
from keras_safe_dist.backend.jax.train_step_layout import distribution_name
from keras_safe_dist.backend.jax.train_step_layout import examples
from keras_safe_dist.backend.jax.train_step_layout import misplaced
from keras_safe_dist.findings import Finding

__all__ = ["layout_findings", "laid_out"]

_CAUSE = (
    "they were created before `keras.distribution.set_distribution(...)` (or outside "
    "`distribution.scope()`, or under another distribution), so they stay where they "
    "were created"
)
_FIX = (
    "Call `keras.distribution.set_distribution(...)` before creating the model, the "
    "optimizer and the metrics (or create them under `distribution.scope()`)."
)


def layout_findings(model):
    """`JAX002` when a variable of `model` is not laid out as the distribution says.

    Checks the model's variables, its optimizer's and its metrics' (those
    built so far) against the distribution in effect, when one spans several
    devices.

    Args:
        model: a built `keras.Model`.

    Returns:
        A list of at most one finding.
    """
    distribution = current_distribution()
    if distribution is None:
        return []
    variables = _variables(model)
    wrong = _misplaced_variables(distribution, variables, _references(model))
    if not wrong:
        return []
    if _is_safe_distributed(model):
        consequence = (
            "SafeDistributedModel lays them out on the distribution once, before its "
            "first step, and warns"
        )
    else:
        consequence = (
            "keras.Model.fit() fails on them with 'Received incompatible devices for "
            "jitted computation'"
        )
    return [
        Finding.of(
            "JAX002",
            f"model '{model.name}'",
            f"{_summary(distribution, wrong, variables)}: {_CAUSE}; {consequence}.",
            _FIX,
        )
    ]


def laid_out(model):
    """Lays the variables of `model` out on the distribution, where they are not; warns once.

    Called before Keras compiles a step, once the optimizer and the metrics
    are built. After it nothing is misplaced, so a later call does nothing.

    Args:
        model: a `SafeDistributedModel` on the JAX backend.

    Raises:
        ValueError: with several processes, where each process created its
            own values on its own device: the message names the variables
            and the fix.
    """
    # Any distribution, one device's too: variables laid out for another
    # distribution (over more devices) are misplaced there as well.
    distribution = keras.distribution.distribution()
    if distribution is None:
        return
    variables = _variables(model)
    wrong = _misplaced_variables(distribution, variables, _references(model))
    if not wrong:
        return
    summary = _summary(distribution, wrong, variables)
    if jax.process_count() > 1:
        raise ValueError(
            f"SafeDistributedModel '{model.name}': {summary}: {_CAUSE}. With "
            f"{jax.process_count()} processes each holds its own values, which cannot be "
            f"laid out as one array without knowing they agree (JAX002). {_FIX}"
        )
    for variable, layout, _ in wrong:
        _jax_compat.lay_out_variable(variable, layout)
    _warnings.warn(
        f"SafeDistributedModel '{model.name}': {summary}: {_CAUSE}. They are now laid "
        f"out on the distribution, once, with their values unchanged (JAX002). {_FIX}"
    )


def _variables(model):
    variables = {}
    optimizer = getattr(model, "optimizer", None)
    groups = [model.variables, optimizer.variables if optimizer is not None else []]
    groups.append(model.metrics_variables)
    for group in groups:
        for variable in group:
            variables.setdefault(id(variable), variable)
    return list(variables.values())


def _references(model):
    """`{id(variable): the variable it is laid out like}`.

    An optimizer's slots (Adam's moments) and the update engine's
    per-variable state (accumulators, the NaN detector's copies) take their
    variable's layout, not one of their own path's: under `ModelParallel`
    they are sharded as the variable is.
    """
    references = {}
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        references.update(
            _jax_compat.optimizer_slot_references(optimizer, model.trainable_variables)
        )
    engine = getattr(model, "_update_engine", None)
    if engine is not None:
        references.update(engine.laid_out_like)
    return references


def _expected_layout(distribution, variable, references):
    # A copy of an optimizer slot follows the slot, which follows its weight.
    while id(variable) in references:
        variable = references[id(variable)]
    return _jax_compat.fresh_variable_layout(distribution, variable)


def _misplaced_variables(distribution, variables, references):
    """`(variable, layout, problem)` for each variable not laid out as `distribution` says."""
    wrong = []
    for variable in variables:
        layout = _expected_layout(distribution, variable, references)
        problem = misplaced(variable.value, getattr(layout, "backend_layout", layout))
        if problem:
            wrong.append((variable, layout, problem))
    return wrong


def _summary(distribution, wrong, variables):
    shown = examples([f"{variable.path} {problem}" for variable, _, problem in wrong])
    return (
        f"{len(wrong)} of {len(variables)} variables of the model, optimizer and metrics "
        f"are not laid out as {distribution_name(distribution)} lays out their variables ({shown})"
    )


def _is_safe_distributed(model):
    from keras_safe_dist.model import SafeDistributedModel

    return isinstance(model, SafeDistributedModel)
