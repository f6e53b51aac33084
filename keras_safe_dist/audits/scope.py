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


from keras_safe_dist import _compat
from keras_safe_dist.audits import _variables
from keras_safe_dist.audits._creation import created_at
from keras_safe_dist.audits._tensorflow import compat as _tf_compat
from keras_safe_dist.audits.aggregation import describe_strategy
from keras_safe_dist.core import creation_site
from keras_safe_dist.core._lazy import tensorflow as tf
from keras_safe_dist.findings import Finding

__all__ = [
    "ScopeError",
    "check_scope",
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
