"""Where variables were created: recorded as TensorFlow creates them, and watched during `fit()`.

`created_at(variable)` names the line that created a variable, so a scope
finding can say which line to move into `with strategy.scope():`.
`CreationWatch` records the variables created outside a strategy's scope
while it is active (`ScopeAuditCallback` runs one during `fit()`).
"""

import weakref

import keras

from keras_safe_dist.audits import _variables
from keras_safe_dist.audits._tensorflow import compat as _tf_compat
from keras_safe_dist.audits.aggregation import describe_strategy
from keras_safe_dist.core import UNKNOWN_SITE
from keras_safe_dist.core import creation_site
from keras_safe_dist.core._lazy import tensorflow as tf
from keras_safe_dist.findings import Finding

__all__ = ["CreationWatch", "created_at"]


class CreationWatch:
    """Records variables created outside a strategy's scope while active.

    Uses `tf.variable_creator_scope`, which tf.function tracing inherits, so
    variables created lazily inside the train step are seen too. Only the
    thread that called `start()` is watched. A variable is recorded when it
    was created outside the strategy's scope and does not belong to the
    strategy (`_variables.belongs_to`): under `OneDeviceStrategy` or the
    default strategy a plain variable is right wherever it was created.

    `findings()` reports a recorded variable only if something still holds
    it: Keras creates throwaway objects while training, such as the reference
    `Optimizer(1.0)` its saving code builds on each `save_weights()` (in
    `BackupAndRestore` and `ModelCheckpoint`) to list an optimizer's own
    attributes, whose variables are dropped at once and never used by
    training.

    Args:
        strategy: the strategy variables should be created under.

    Example:

    ```python
    watch = CreationWatch(strategy)
    watch.start()
    try:
        counter = keras.Variable(0.0)  # outside `strategy.scope()`
    finally:
        watch.stop()
    print([f.subject for f in watch.findings()])  # ["variable 'variable'"]
    ```
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self._scope = None
        self._pending = []
        self._found = {}

    def start(self):
        """Starts recording the variables this thread creates."""
        self._scope = tf.variable_creator_scope(self._creator)
        self._scope.__enter__()

    def stop(self):
        """Stops recording; what was recorded stays for `findings()`."""
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(None, None, None)

    def _creator(self, next_creator, **kwargs):
        variable = next_creator(**kwargs)
        current = tf.distribute.get_strategy()
        if self._scope is None or current is self.strategy:
            return variable
        name = kwargs.get("name") or "unnamed"
        if _variables.distributes_variables(current):
            # Another strategy's creator is making one copy per device of a
            # variable it distributes; the copies after the first are named
            # "<name>/replica_<i>/". Record the variable once.
            if "/replica_" in name:
                return variable
            owner = current
        elif _variables.belongs_to(variable, self.strategy):
            return variable
        else:
            owner = _variables.strategy_of(variable)
        self._pending.append((name, creation_site(), _weak(variable), owner))
        return variable

    def findings(self):
        """One `SCOPE005` finding per name of a variable created outside the scope.

        Variables recorded since the last call count when something still
        holds them; once counted, a name stays reported.

        Returns:
            A list of `SCOPE005` findings, each naming the code that created
            the variable and, when there were several, how many.
        """
        pending, self._pending = self._pending, []
        for name, site, ref, owner in pending:
            if ref() is None:
                continue
            if name in self._found:
                self._found[name][2] += 1
            else:
                self._found[name] = [site, owner, 1]
        strategy = describe_strategy(self.strategy)
        return [
            Finding.of(
                "SCOPE005",
                f"variable '{name}'",
                f"created during fit() outside the scope of the {strategy} "
                f"that trains the model, by {site}"
                + (f" ({count} variables of this name)" if count > 1 else "")
                + f": {_held_as(owner)}",
                "Create it before fit() inside `with strategy.scope():`, or "
                "wrap its creation in `with self.model.distribute_strategy."
                "scope():`.",
            )
            for name, (site, owner, count) in self._found.items()
        ]


def _weak(variable):
    try:
        return weakref.ref(variable)
    except TypeError:
        return lambda: variable


def _held_as(owner):
    if owner is _tf_compat.default_strategy():
        return "it is a plain variable on one device, not mirrored across replicas."
    return f"it belongs to another {describe_strategy(owner)}."


# Where each variable was created, recorded as TensorFlow creates it: a
# variable creator scope that the importing thread enters for good when the
# package is imported. It records, and changes nothing. A model built outside
# the scope is often wrapped inside it, so only this tells its lines.
_SITE = "_keras_safe_dist_created_at"


def created_at(variable):
    """Where `variable` was created, as `creation_site()` put it, or None.

    Known for the variables created, after keras_safe_dist was imported, on
    the thread that imported it (outside any other variable creator scope).

    Args:
        variable: a Keras or TensorFlow variable, possibly distributed.

    Returns:
        A str, `"file.py:12 in make_model"`, or None when not recorded.

    Example:

    ```python
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(1)
    outputs = dense(inputs)  # creates the variables
    print(created_at(dense.kernel))  # train.py:3 in <module>
    ```
    """
    value = _variables.tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    return getattr(value, _SITE, None)


def _record_site(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    site = creation_site()
    if site != UNKNOWN_SITE:
        try:
            setattr(variable, _SITE, site)
        except AttributeError:  # a variable type without a __dict__
            pass
    return variable


def _record_creation_sites():
    """Enters the recording creator scope on this thread, once; returns it or None.

    Not inside another creator scope (such as a strategy's): TensorFlow checks
    that creator scopes exit in the order they were entered, and that outer
    scope would exit before this one.
    """
    if _tf_compat.variable_creator_count() > 0:
        return None
    scope = tf.variable_creator_scope(_record_site)
    scope.__enter__()
    return scope


# Held for good: a collected scope would exit. TensorFlow's variables only:
# on JAX no strategy scope places them.
_SITE_SCOPE = _record_creation_sites() if keras.backend.backend() == "tensorflow" else None
