"""Scope findings: objects and variables created outside the training strategy.

TensorFlow reports these late and without naming the object ("Mixing different
tf.distribute.Strategy objects", "Need to be inside with strategy.scope()", or
a bare AssertionError), or not at all: a metric or a variable created by a
callback outside the scope silently lives on one device. The findings here
name the object, where it was built when that can be told, and the line to
move into `with strategy.scope():`.

A variable belongs to the training strategy when it is held the way that
strategy holds variables (`_variables.belongs_to`): under a strategy that
mirrors variables, it was created in that strategy's scope; under the default
strategy or `OneDeviceStrategy`, which create plain variables, any plain
variable does.
"""

import weakref

import keras

from keras_safe_dist import _compat
from keras_safe_dist.audits import _variables
from keras_safe_dist.audits._tensorflow import compat as _tf_compat
from keras_safe_dist.audits.aggregation import describe_strategy
from keras_safe_dist.core import UNKNOWN_SITE
from keras_safe_dist.core import creation_site
from keras_safe_dist.core._lazy import tensorflow as tf
from keras_safe_dist.findings import Finding

__all__ = [
    "CreationWatch",
    "ScopeError",
    "check_scope",
    "created_at",
    "creation_site",
    "current_scope_findings",
    "scope_findings",
    "training_strategy",
]



def training_strategy(model, strategy=None):
    """The strategy `model` trains under.

    The explicit `strategy`, else the one whose scope created the model, else
    the current one, else the first non-default strategy owning optimizer or
    metric variables, else TensorFlow's default strategy.

    Args:
        model: a `keras.Model`.
        strategy: a `tf.distribute.Strategy` to return as is, or None.

    Returns:
        A `tf.distribute.Strategy`.

    Example:

    ```python
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    assert training_strategy(model) is strategy
    ```
    """
    if strategy is not None:
        return strategy
    default = _tf_compat.default_strategy()
    own = _compat.model_strategy(model)
    if own is not None:
        return own
    current = tf.distribute.get_strategy()
    if current is not default:
        return current
    for variable, _, _ in _variables.all_variables(model):
        owner = _variables.strategy_of(variable)
        if owner is not default:
            return owner
    return default


def scope_findings(model, strategy=None, optimizer=None, metrics=()):
    """Objects whose variables belong to another strategy than training's.

    Args:
        model: a `keras.Model`.
        strategy: the training strategy; see `training_strategy`.
        optimizer: the optimizer to check; defaults to `model.optimizer`.
        metrics: metric objects to check in addition to `model.metrics`.

    Returns:
        A list of `Finding`s, one per misplaced object: `SCOPE001` (model),
        `SCOPE002` (optimizer), `SCOPE003` (metric), `SCOPE004` (loss scale).

    Example:

    ```python
    model = make_model()  # built outside the scope: SCOPE001
    with strategy.scope():
        model.compile(optimizer="adam", loss="mse")
    for finding in scope_findings(model, strategy):
        print(finding.code, finding.subject, finding.fix)
    ```
    """
    strategy = training_strategy(model, strategy)
    optimizer = optimizer or getattr(model, "optimizer", None)
    findings = []
    groups = [
        (
            "SCOPE001",
            f"model '{model.name}'",
            model.variables,
            _model_fix(model, strategy),
        )
    ]
    if optimizer is not None:
        roles = _variables.optimizer_roles(optimizer)
        groups.append(
            (
                "SCOPE002",
                f"optimizer '{optimizer.name}'",
                [v for v, role in roles if role != "loss-scale"],
                f"Move the line that creates optimizer '{optimizer.name}' "
                "into `with strategy.scope():`, or pass it to compile() by "
                "name.",
            )
        )
        groups.append(
            (
                "SCOPE004",
                f"loss scale of optimizer '{optimizer.name}'",
                [v for v, role in roles if role == "loss-scale"],
                "Create the LossScaleOptimizer inside `with strategy.scope():`.",
            )
        )
    seen = set()
    for metric in _variables.metrics_of(model) + list(metrics):
        if id(metric) in seen:
            continue
        seen.add(id(metric))
        groups.append(
            (
                "SCOPE003",
                f"metric '{metric.name}'",
                metric.variables,
                f"Create metric '{metric.name}' inside `with strategy.scope():`, "
                "or pass it to compile() by name.",
            )
        )
    for code, subject, variables, fix in groups:
        finding = _misplaced(code, subject, variables, strategy, fix)
        if finding is not None:
            findings.append(finding)
    return findings


def _model_fix(model, strategy):
    """Move the lines that created the model's misplaced variables.

    Those lines come from the sites recorded when the variables were created
    (`created_at`). A model that wraps layers built earlier
    (`SafeDistributedModel(inputs=m.inputs, outputs=m.outputs)`) was made
    elsewhere: moving that line into the scope is not enough, and the fix
    says so. Without a recorded site, the line that made the model.

    Args:
        model: the `keras.Model` checked.
        strategy: the training strategy.

    Returns:
        The fix, one sentence.
    """
    made_at = getattr(model, "_safe_dist_built_at", None)
    wrong = [v for v in model.variables if not _variables.belongs_to(v, strategy)]
    sites = list(dict.fromkeys(s for s in map(created_at, wrong) if s is not None))
    if not sites:
        sites = [made_at] if made_at else []
    if not sites:
        return f"Move the line that builds model '{model.name}' into `with strategy.scope():`."
    shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
    lines = "lines that build" if len(sites) > 1 else "line that builds"
    fix = f"Move the {lines} model '{model.name}' (built at {shown}) into `with strategy.scope():`"
    if made_at and made_at not in sites:
        fix += f": its variables were created there, not where the model was made ({made_at})"
    return fix + "."


def _misplaced(code, subject, variables, strategy, fix):
    wrong = [v for v in variables if not _variables.belongs_to(v, strategy)]
    if not wrong:
        return None
    example = _variables.describe(wrong[0], subject, "")
    owner = _variables.strategy_of(wrong[0])
    where = (
        "no strategy (created outside every `strategy.scope()`)"
        if owner is _tf_compat.default_strategy()
        else f"another {describe_strategy(owner)}"
    )
    return Finding.of(
        code,
        subject,
        f"{len(wrong)} of {len(variables)} variables belong to {where}, not to "
        f"the {describe_strategy(strategy)} that trains it (e.g. "
        f"{example.path} is {example.container} on "
        f"{', '.join(example.devices)}).",
        fix,
    )


class ScopeError(ValueError):
    """An object was built outside the strategy that trains the model.

    Raised by `check_scope`, hence by `SafeDistributedModel.compile()` and
    `fit()`. The message has one line per finding, with its fix.

    Args:
        where: the call that found the problem, e.g.
            `"SafeDistributedModel.fit()"`.
        findings: the `SCOPE*` findings, each naming the object and the fix.

    Attributes:
        findings: the `SCOPE*` findings, as a tuple.

    Example:

    ```python
    try:
        model.fit(x, y)
    except keras_safe_dist.ScopeError as error:
        for finding in error.findings:
            print(finding.code, finding.subject, finding.fix)
    ```
    """

    def __init__(self, where, findings):
        self.findings = tuple(findings)
        if [f.code for f in self.findings] == ["SCOPE006"]:
            header = f"{where} was called inside the scope of another strategy:"
        else:
            header = (
                f"{where} found objects built outside the strategy that trains "
                "the model:"
            )
        lines = [header]
        for f in self.findings:
            lines.append(f"- [{f.code}] {f.subject}: {f.message} Fix: {f.fix}")
        super().__init__("\n".join(lines))


def check_scope(where, model, strategy=None, optimizer=None, metrics=()):
    """Raises `ScopeError` when the call or the objects are in the wrong scope.

    Checks `current_scope_findings` (the call is made inside another
    strategy's scope) first: when it fails, that finding alone is raised,
    since what the call creates itself (an optimizer given by name) lands in
    that other scope too. Then checks `scope_findings` (the objects'
    variables).

    Args:
        where: the call being checked, e.g. `"SafeDistributedModel.fit()"`.
        model: a `keras.Model`.
        strategy: the training strategy; see `training_strategy`.
        optimizer: the optimizer to check; defaults to `model.optimizer`.
        metrics: metric objects to check in addition to `model.metrics`.

    Raises:
        ScopeError: carrying the `SCOPE*` errors found.

    Example:

    ```python
    check_scope("my_train_loop()", model, strategy)  # returns None when all is well
    ```
    """
    strategy = training_strategy(model, strategy)
    findings = current_scope_findings(where, model, strategy)
    if not findings:
        findings = scope_findings(model, strategy, optimizer, metrics)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise ScopeError(where, errors)


def current_scope_findings(where, model, strategy=None):
    """`SCOPE006` when `where` runs inside another strategy's scope.

    Keras enters the scope of the strategy that built the model in `fit()`,
    and TensorFlow refuses to enter one strategy's scope inside another's
    ("Mixing different tf.distribute.Strategy objects"). The default
    strategy's scope is no scope, so it is never reported.

    Args:
        where: the call being checked, e.g. `"SafeDistributedModel.fit()"`.
        model: a `keras.Model`.
        strategy: the training strategy; see `training_strategy`.

    Returns:
        A list with one `SCOPE006` finding, or an empty list.

    Example:

    ```python
    with other_strategy.scope():
        findings = current_scope_findings("fit()", model, strategy)
    print([f.code for f in findings])  # ['SCOPE006']
    ```
    """
    strategy = training_strategy(model, strategy)
    current = tf.distribute.get_strategy()
    if not tf.distribute.has_strategy() or current is strategy:
        return []
    trains = describe_strategy(strategy)
    return [
        Finding.of(
            "SCOPE006",
            f"model '{model.name}'",
            f"{where} was called inside `with strategy.scope():` of another "
            f"strategy, a {describe_strategy(current)}, but the model belongs "
            f"to the {trains} that built it: TensorFlow refuses to mix them "
            "('Mixing different tf.distribute.Strategy objects').",
            f"Call {where} outside that `with strategy.scope():` block, or "
            f"inside the scope of the {trains} (`with "
            "model.distribute_strategy.scope():`).",
        )
    ]


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
