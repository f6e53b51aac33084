"""An inventory of a model's variables and how tf.distribute holds them."""

import dataclasses

import keras
import numpy as np

from keras_safe_dist.audits._tensorflow import compat as _tf_compat
from keras_safe_dist.core._lazy import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """How one variable is aggregated and placed.

    Attributes:
        path: the variable's path, e.g. `"sequential/dense/kernel"`.
        owner: the object holding it: a layer path, `"optimizer 'adam'"` or
            `"metric 'auc'"`.
        role: `"trainable"`, `"non-trainable"`, `"optimizer-slot"`,
            `"optimizer-state"`, `"loss-scale"` or `"metric"`.
        aggregation: the Keras aggregation (`"none"`, `"mean"`, `"sum"`,
            `"only_first_replica"`).
        synchronization: the Keras synchronization (`"auto"`, `"on_write"`,
            `"on_read"`, `"none"`).
        tf_aggregation: the `tf.VariableAggregation` name it maps to.
        container: `"mirrored"`, `"on-read"` or `"plain"`.
        devices: the devices holding its copies.
        dtype: its dtype name.
    """

    path: str
    owner: str
    role: str
    aggregation: str
    synchronization: str
    tf_aggregation: str
    container: str
    devices: tuple
    dtype: str

    def to_dict(self):
        return {**dataclasses.asdict(self), "devices": list(self.devices)}


def tf_variable(variable):
    """The `tf.Variable` (possibly distributed) behind a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _plain_strategies():
    """Strategies whose scope creates plain, one-device variables, like no scope."""
    return (tf.distribute.OneDeviceStrategy, tf.compat.v1.distribute.OneDeviceStrategy)


def strategy_of(variable):
    """The strategy whose scope created `variable`; the default one if none."""
    value = tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return _tf_compat.distributed_strategy(value)
    return _tf_compat.default_strategy()


def distributes_variables(strategy):
    """Whether variables created in `strategy`'s scope are distributed.

    False for TensorFlow's default strategy and `OneDeviceStrategy`: both
    create plain variables, as if no scope were entered.
    """
    return strategy is not _tf_compat.default_strategy() and not isinstance(
        strategy, _plain_strategies()
    )


def belongs_to(variable, strategy):
    """Whether `variable` is held the way `strategy` holds its variables.

    Under a strategy that distributes variables, `variable` must have been
    created in that strategy's scope. Under one that does not (the default
    strategy, `OneDeviceStrategy`), any plain variable is right, wherever it
    was created; a variable distributed by another strategy is not.
    """
    if strategy_of(variable) is strategy:
        return True
    if distributes_variables(strategy):
        return False
    return not isinstance(tf_variable(variable), tf.distribute.DistributedValues)


def local_values(variable):
    """The values of `variable` on each of its devices, as numpy arrays."""
    value = tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return [np.array(v.read_value()) for v in value.values]
    return [np.array(value.read_value())]


def describe(variable, owner, role):
    """The `VariableInfo` of one variable."""
    value = tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        copies = value.values
        on_read = value.synchronization == tf.VariableSynchronization.ON_READ
        container = "on-read" if on_read else "mirrored"
    else:
        copies = (value,)
        container = "plain"
    keras_variable = isinstance(variable, keras.Variable)
    return VariableInfo(
        path=variable.path if keras_variable else variable.name,
        owner=owner,
        role=role,
        aggregation=variable.aggregation if keras_variable else _keras_name(value.aggregation),
        synchronization=(
            variable.synchronization
            if keras_variable
            else _keras_name(value.synchronization)
        ),
        tf_aggregation=value.aggregation.name,
        container=container,
        devices=tuple(c.device for c in copies),
        dtype=tf.as_dtype(value.dtype).name,
    )


def inventory(model):
    """`(variable, VariableInfo)` for every variable of model, optimizer, metrics.

    Returns:
        A list in the order of `all_variables`.
    """
    return [
        (variable, describe(variable, owner, role))
        for variable, owner, role in all_variables(model)
    ]


def all_variables(model):
    """`(variable, owner, role)` for every variable of model, optimizer, metrics.

    Returns:
        A list in a stable order, each variable once: model variables, then
        the optimizer's, then each metric's.
    """
    rows = []
    seen = set()

    def add(variable, owner, role):
        if id(variable) not in seen:
            seen.add(id(variable))
            rows.append((variable, owner, role))

    for variable in model.trainable_variables:
        add(variable, _owner_of(variable), "trainable")
    for variable in model.non_trainable_variables:
        add(variable, _owner_of(variable), "non-trainable")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        owner = f"optimizer '{optimizer.name}'"
        for variable, role in optimizer_roles(optimizer):
            add(variable, owner, role)
    for metric in metrics_of(model):
        for variable in metric.variables:
            add(variable, f"metric '{metric.name}'", "metric")
    return rows


def metrics_of(model):
    """The model's metrics, with compiled metric containers opened up."""
    flat = []

    def add(metric):
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner:
            for m in inner:
                add(m)
        else:
            flat.append(metric)

    for metric in model.metrics:
        add(metric)
    return flat


def optimizer_roles(optimizer):
    """`(variable, role)` for each optimizer variable.

    Counters and hyperparameters (scalars aggregated on the first replica) are
    `"optimizer-state"`, a `LossScaleOptimizer`'s scale and step counter are
    `"loss-scale"`, everything else is an `"optimizer-slot"`.
    """
    loss_scale = {
        id(getattr(optimizer, name))
        for name in ("dynamic_scale", "step_counter")
        if isinstance(getattr(optimizer, name, None), keras.Variable)
    }
    roles = []
    for variable in optimizer.variables:
        if id(variable) in loss_scale:
            role = "loss-scale"
        elif len(variable.shape) == 0 and variable.aggregation == "only_first_replica":
            role = "optimizer-state"
        else:
            role = "optimizer-slot"
        roles.append((variable, role))
    return roles


def _owner_of(variable):
    path = getattr(variable, "path", variable.name)
    return path.rsplit("/", 1)[0] if "/" in path else path


def _keras_name(enum_value):
    return {
        "AUTO": "auto",
        "ON_WRITE": "on_write",
        "ON_READ": "on_read",
        "NONE": "none",
        "SUM": "sum",
        "MEAN": "mean",
        "ONLY_FIRST_REPLICA": "only_first_replica",
    }[enum_value.name]
