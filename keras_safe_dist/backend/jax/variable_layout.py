"""Variables created before the `keras.distribution` distribution was set, laid out on it.

A `keras.Variable` takes its layout from the distribution in effect when it
is created. A model (or optimizer, or metric) created before
`keras.distribution.set_distribution(...)` keeps its variables on one
device, and Keras's jitted step then fails on the mix ("Received
incompatible devices for jitted computation"). `SafeDistributedModel` lays
such variables out on the distribution once, before its first step, and
warns (`lay_out`); `keras_safe_dist.audit()` reports them as `JAX002`
(`layout_audit.py`, from `misplaced_variables`). The check is LOOP004's
(`train_step_layout`), on the variables instead of a custom loop's state.
Only imported on the JAX backend.
"""

import jax
import keras

from keras_safe_dist.backend.jax import _compat as _jax_compat
from keras_safe_dist.backend.jax.train_step_layout import distribution_name
from keras_safe_dist.backend.jax.train_step_layout import examples
from keras_safe_dist.backend.jax.train_step_layout import misplaced
from keras_safe_dist.core import _warnings

__all__ = ["CAUSE", "FIX", "lay_out", "misplaced_variables"]

CAUSE = (
    "they were created before `keras.distribution.set_distribution(...)` (or outside "
    "`distribution.scope()`, or under another distribution), so they stay where they "
    "were created"
)
FIX = (
    "Call `keras.distribution.set_distribution(...)` before creating the model, the "
    "optimizer and the metrics (or create them under `distribution.scope()`)."
)


def lay_out(model):
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
    wrong, summary = misplaced_variables(model, distribution)
    if not wrong:
        return
    if jax.process_count() > 1:
        raise ValueError(
            f"SafeDistributedModel '{model.name}': {summary}: {CAUSE}. With "
            f"{jax.process_count()} processes each holds its own values, which cannot be "
            f"laid out as one array without knowing they agree (JAX002). {FIX}"
        )
    for variable, layout, _ in wrong:
        _jax_compat.lay_out_variable(variable, layout)
    _warnings.warn(
        f"SafeDistributedModel '{model.name}': {summary}: {CAUSE}. They are now laid "
        f"out on the distribution, once, with their values unchanged (JAX002). {FIX}"
    )


def misplaced_variables(model, distribution):
    """The variables of `model` not laid out as `distribution` says, and their summary.

    Checks the model's variables, its optimizer's and its metrics' (those
    built so far); an optimizer slot or our own per-variable state is
    expected laid out as its variable.

    Args:
        model: a built `keras.Model`.
        distribution: a `keras.distribution.Distribution`.

    Returns:
        `(wrong, summary)`: a list of `(variable, layout, problem)`, and a
        str naming how many of how many variables and examples (`""` when
        none is wrong).
    """
    variables = _variables(model)
    wrong = _misplaced_variables(distribution, variables, _references(model))
    return wrong, (_summary(distribution, wrong, variables) if wrong else "")


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
