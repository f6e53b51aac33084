"""`LOOP004` on JAX: the state and the batch laid out as the Keras distribution says.

Under a `keras.distribution` distribution (`DataParallel`, `ModelParallel`),
each variable has a layout (`distribution.get_variable_layout(variable)`:
replicated for `DataParallel`) and each batch one
(`distribution.get_data_layout(shape)`: split along the batch dimension).
`fit()` places both itself; a custom loop must: a model built outside the
distribution's scope leaves its state on one device, and a batch fed as a
NumPy array is copied whole to every device, so each device computes the
whole batch. Only imported on the JAX backend.
"""

import jax
import keras

from keras_safe_dist.findings import Finding

__all__ = [
    "batch_findings", "current_distribution", "distribution_name", "examples", "is_chief",
    "misplaced", "state_findings",
]

_EXAMPLES = 3


def current_distribution():
    """The distribution in effect, or None when none spans several devices."""
    distribution = keras.distribution.distribution()
    if distribution is None or distribution.device_mesh.devices.size < 2:
        return None
    return distribution


def is_chief():
    """Whether this process writes files: JAX process 0."""
    return jax.process_index() == 0


def state_findings(distribution, train_state, state, where):
    """`LOOP004` when a value of `state` is not laid out as its variable's layout.

    Args:
        distribution: the `keras.distribution.Distribution` in effect.
        train_state: the `TrainState` (the variables behind each value).
        state: a tuple of lists of arrays.
        where: `"passed in"` (the model's variables) or `"returned"`.

    Returns:
        A list of at most one finding.
    """
    wrong = []
    count = 0
    for (_, variables), values in zip(train_state.groups, state):
        for variable, value in zip(variables, values):
            count += 1
            layout = distribution.get_variable_layout(variable)
            expected = getattr(layout, "backend_layout", layout)
            problem = misplaced(value, expected)
            if problem:
                wrong.append(f"{variable.path} {problem}")
    if not wrong:
        return []
    if where == "passed in":
        cause = (
            "the model's or optimizer's variables were created outside the "
            "distribution's scope"
        )
        fix = (
            "Create the model and the optimizer, and build the optimizer, under "
            "`distribution.scope()` (or after `keras.distribution.set_distribution`)."
        )
    else:
        cause = (
            "the train step moves them (to the host as NumPy arrays, or with a "
            "`jax.device_put` or `out_shardings`)"
        )
        fix = (
            "Return the arrays as `stateless_call` and `stateless_apply` produce them, "
            "or place each with `distribution.get_variable_layout(variable)`."
        )
    return [
        Finding.of(
            "LOOP004",
            f"state {where}",
            f"{len(wrong)} of {count} state values {where} are not laid out as "
            f"{distribution_name(distribution)} lays out their variables ({examples(wrong)}): "
            f"{cause}.",
            fix,
        )
    ]


def batch_findings(distribution, data):
    """`LOOP004` when an array of the batch is not split as the distribution's data layout.

    Args:
        distribution: the `keras.distribution.Distribution` in effect.
        data: the batch given to the step (any nest of arrays).

    Returns:
        A list of at most one finding.
    """
    wrong = []
    leaves = [leaf for leaf in keras.tree.flatten(data) if len(getattr(leaf, "shape", ())) > 0]
    for position, leaf in enumerate(leaves):
        layout = distribution.get_data_layout(tuple(leaf.shape))
        problem = misplaced(leaf, getattr(layout, "backend_layout", layout))
        if problem:
            wrong.append(f"array {position} of shape {tuple(leaf.shape)} {problem}")
    if not wrong:
        return []
    return [
        Finding.of(
            "LOOP004",
            "batch",
            f"{len(wrong)} of {len(leaves)} batch arrays are not split along the batch "
            f"dimension as {distribution_name(distribution)} says ({examples(wrong)}): the step "
            "computes the whole batch on every device (or fails on mixed devices) "
            "instead of a share on each.",
            "Place each batch with `keras.distribution.distribute_tensor(x, "
            "distribution.get_data_layout(x.shape))` before the step, as fit() does.",
        )
    ]


def misplaced(value, expected):
    """Why `value` is not laid out as `expected` (a `jax.sharding.Sharding`), or None."""
    if expected is None:
        return None  # the distribution gives no layout: any is right
    if not isinstance(value, jax.Array):
        return f"is a {type(value).__module__.split('.')[0]} {type(value).__name__}, on no device"
    try:
        if value.sharding.is_equivalent_to(expected, value.ndim):
            return None
    except (TypeError, ValueError):
        pass
    devices = sorted(str(d) for d in value.sharding.device_set)
    spec = getattr(value.sharding, "spec", None)
    where = f"on {', '.join(devices)}" + (f" as {spec}" if spec is not None else "")
    want = getattr(expected, "spec", expected)
    return f"is {where}, not {want} over {len(expected.device_set)} devices"


def examples(items):
    shown = "; ".join(items[:_EXAMPLES])
    more = len(items) - _EXAMPLES
    return shown + (f"; and {more} more" if more > 0 else "")


def distribution_name(distribution):
    return f"{type(distribution).__name__} over {distribution.device_mesh.devices.size} devices"
