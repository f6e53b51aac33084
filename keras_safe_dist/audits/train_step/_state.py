"""The state a stateless train step threads, built from the model and checked on return.

Keras's custom-loop convention (its JAX guide): `train_step(state, data)`
returns `(loss or logs, state)`, where `state` is `(trainable_variables,
non_trainable_variables, optimizer_variables)` as lists of values in the
order of `model.trainable_variables`, `model.non_trainable_variables` and
`optimizer.variables`, and optionally a fourth list, the metrics' variables.
"""

import keras
import numpy as np

__all__ = ["ModelSnapshot", "TrainState", "describe", "host_values"]


class TrainState:
    """The variables behind each element of the state, in the convention's order.

    Args:
        model: a built `keras.Model`.
        optimizer: a built `keras.optimizers.Optimizer`.
        metrics: a list of `keras.metrics.Metric` whose variables form the
            fourth element, or None for a state of three.
    """

    def __init__(self, model, optimizer, metrics=None):
        self.groups = [
            ("trainable_variables", list(model.trainable_variables)),
            ("non_trainable_variables", list(model.non_trainable_variables)),
            ("optimizer_variables", list(optimizer.variables)),
        ]
        if metrics is not None:
            variables = [v for metric in metrics for v in metric.variables]
            self.groups.append(("metrics_variables", variables))
        self.names = tuple(name for name, _ in self.groups)

    def index(self, group, variable):
        """The position of `variable` in `group`'s list, or None."""
        for position, candidate in enumerate(dict(self.groups)[group]):
            if candidate is variable:
                return position
        return None

    def initial(self):
        """A copy of the variables' values, as a tuple of lists.

        A copy, so that a step that donates its arguments (`jax.jit(...,
        donate_argnums=0)`) cannot invalidate the model's own arrays.
        """
        return tuple(
            [keras.ops.copy(v.value) for v in variables] for _, variables in self.groups
        )

    def expected(self):
        """What a step must return, in words, for error messages."""
        lists = ", ".join(
            f"{name} ({len(variables)} values)" for name, variables in self.groups
        )
        return f"`(loss or logs, state)` with `state = ({lists})`"

    def checked(self, result, step_name):
        """`(value, state)` from a step's `result`, after checking its shape.

        Raises:
            ValueError: when `result` is not a pair, its state not a tuple or
                list of as many lists as expected, a list of the wrong length,
                or a value of the wrong shape; the message says what was
                expected, what was received and what to do.
        """
        hint = (
            f"Return {self.expected()}, each list in the order of "
            + ", ".join(_ORIGIN[name] for name in self.names)
            + "."
        )
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise ValueError(
                f"The train step {step_name} must return a pair `(loss or logs, "
                f"state)`. Received: {describe(result)}. {hint}"
            )
        value, state = result
        if not isinstance(state, (tuple, list)) or len(state) != len(self.groups):
            raise ValueError(
                f"The train step {step_name} must return a state of "
                f"{len(self.groups)} lists ({', '.join(self.names)}). Received "
                f"as state: {describe(state)}. {hint}"
            )
        for position, ((name, variables), values) in enumerate(zip(self.groups, state)):
            where = f"state[{position}] ({name})"
            if not isinstance(values, (tuple, list)) or len(values) != len(variables):
                raise ValueError(
                    f"The train step {step_name} returned a {where} that is not a list "
                    f"of {len(variables)} values. Received: {describe(values)}. {hint}"
                )
            for variable, returned in zip(variables, values):
                shape = tuple(getattr(returned, "shape", ()) or ())
                if shape != tuple(variable.shape):
                    raise ValueError(
                        f"The train step {step_name} returned in {where} a value of "
                        f"shape {shape} where {variable.path} has shape "
                        f"{tuple(variable.shape)}. {hint}"
                    )
        return value, tuple(list(values) for values in state)


_ORIGIN = {
    "trainable_variables": "model.trainable_variables",
    "non_trainable_variables": "model.non_trainable_variables",
    "optimizer_variables": "optimizer.variables",
    "metrics_variables": "the metrics' variables",
}


def host_values(state):
    """The state as NumPy arrays: a tuple of lists."""
    return tuple([np.array(keras.ops.convert_to_numpy(v)) for v in values] for values in state)


class ModelSnapshot:
    """The values of every variable of the model, optimizer and metrics, to restore.

    On JAX a variable's value is an immutable array, kept as it is; on other
    backends a copy is kept.
    """

    def __init__(self, model, optimizer, metrics=()):
        variables = {}
        for variable in (
            list(model.variables)
            + list(optimizer.variables)
            + [v for metric in metrics for v in metric.variables]
        ):
            variables.setdefault(id(variable), variable)
        self._jax = keras.backend.backend() == "jax"
        self._saved = [
            (v, v.value if self._jax else keras.ops.copy(v.value))
            for v in variables.values()
        ]

    def restore(self):
        """Assigns back each value that changed; returns the paths restored."""
        restored = []
        for variable, saved in self._saved:
            if self._jax:
                changed = variable.value is not saved
            else:
                changed = not np.array_equal(
                    keras.ops.convert_to_numpy(variable.value),
                    keras.ops.convert_to_numpy(saved),
                )
            if changed:
                variable.assign(saved)
                restored.append(variable.path)
        return restored


def describe(value, depth=0):
    """A short description of `value`'s structure, for error messages."""
    if isinstance(value, (tuple, list)):
        kind = type(value).__name__
        if depth >= 2 or len(value) > 6:
            arrays = sum(1 for v in value if hasattr(v, "shape"))
            return f"a {kind} of {len(value)} elements ({arrays} arrays)"
        inner = ", ".join(describe(v, depth + 1) for v in value)
        return f"a {kind} of {len(value)}: ({inner})"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    return f"a {type(value).__name__}"
