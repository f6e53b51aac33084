"""Scope findings: objects and variables created outside the training strategy.

TensorFlow reports these late and without naming the object ("Mixing different
tf.distribute.Strategy objects", "Need to be inside with strategy.scope()", or
a bare AssertionError), or not at all: a metric or a variable created by a
callback outside the scope silently lives on one device. The findings here
name the object, where it was built when that can be told, and the line to
move into `with strategy.scope():`.
"""

import inspect
import os

import keras
import tensorflow as tf

from keras_safe_dist import _compat
from keras_safe_dist.audits import _variables
from keras_safe_dist.audits.aggregation import describe_strategy
from keras_safe_dist.findings import Finding

__all__ = [
    "CreationWatch",
    "ScopeError",
    "check_scope",
    "creation_site",
    "scope_findings",
    "training_strategy",
]

# Frames in these folders are library code; the Python library folder also
# holds site-packages, so Keras, TensorFlow and their dependencies are covered.
_LIBRARIES = (
    os.path.dirname(os.__file__) + os.sep,
    os.path.dirname(_compat.__file__) + os.sep,
    os.path.dirname(keras.__file__) + os.sep,
    os.path.dirname(tf.__file__) + os.sep,
)


def training_strategy(model, strategy=None):
    """The strategy `model` trains under.

    The explicit `strategy`, else the one whose scope created the model, else
    the current one, else the first non-default strategy owning optimizer or
    metric variables, else TensorFlow's default strategy.
    """
    if strategy is not None:
        return strategy
    default = _compat.default_strategy()
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
    """
    strategy = training_strategy(model, strategy)
    optimizer = optimizer or getattr(model, "optimizer", None)
    findings = []
    built_at = getattr(model, "_safe_dist_built_at", None)
    at = f" (built at {built_at})" if built_at else ""
    groups = [
        (
            "SCOPE001",
            f"model '{model.name}'",
            model.variables,
            f"Move the line that builds model '{model.name}'{at} into "
            "`with strategy.scope():`.",
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


def _misplaced(code, subject, variables, strategy, fix):
    wrong = [v for v in variables if _variables.strategy_of(v) is not strategy]
    if not wrong:
        return None
    example = _variables.describe(wrong[0], subject, "")
    owner = _variables.strategy_of(wrong[0])
    where = (
        "no strategy (created outside every `strategy.scope()`)"
        if owner is _compat.default_strategy()
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

    Attributes:
        findings: the `SCOPE*` findings, each naming the object and the fix.
    """

    def __init__(self, where, findings):
        self.findings = tuple(findings)
        lines = [
            f"{where} found objects built outside the strategy that trains "
            "the model:"
        ]
        for f in self.findings:
            lines.append(f"- [{f.code}] {f.subject}: {f.message} Fix: {f.fix}")
        super().__init__("\n".join(lines))


def check_scope(where, model, strategy=None, optimizer=None, metrics=()):
    """Raises `ScopeError` when `scope_findings` has errors.

    Args:
        where: the call being checked, e.g. `"SafeDistributedModel.fit()"`.
        model, strategy, optimizer, metrics: as for `scope_findings`.
    """
    findings = scope_findings(model, strategy, optimizer, metrics)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise ScopeError(where, errors)


class CreationWatch:
    """Records variables created outside a strategy's scope while active.

    Uses `tf.variable_creator_scope`, which tf.function tracing inherits, so
    variables created lazily inside the train step are seen too. Only the
    thread that called `start()` is watched.

    Args:
        strategy: the strategy variables should be created under.
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.created = []
        self._scope = None

    def start(self):
        self._scope = tf.variable_creator_scope(self._creator)
        self._scope.__enter__()

    def stop(self):
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(None, None, None)

    def _creator(self, next_creator, **kwargs):
        if self._scope is not None and tf.distribute.get_strategy() is not self.strategy:
            self.created.append((kwargs.get("name") or "unnamed", creation_site()))
        return next_creator(**kwargs)

    def findings(self):
        """One `SCOPE005` finding per variable created outside the scope."""
        strategy = describe_strategy(self.strategy)
        return [
            Finding.of(
                "SCOPE005",
                f"variable '{name}'",
                f"created during fit() outside the scope of the {strategy} "
                f"that trains the model, by {site}: it is a plain variable on "
                "one device, not mirrored across replicas.",
                "Create it before fit() inside `with strategy.scope():`, or "
                "wrap its creation in `with self.model.distribute_strategy."
                "scope():`.",
            )
            for name, site in self.created
        ]


def creation_site():
    """`"file.py:12 in MyCallback.on_train_begin"` for the innermost user frame.

    User code is the innermost frame outside Keras, TensorFlow and
    keras_safe_dist; `"unknown code"` when there is none.
    """
    frame = inspect.currentframe()
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARIES) and not filename.startswith("<"):
            owner = frame.f_locals.get("self")
            function = frame.f_code.co_name
            if owner is not None:
                function = f"{type(owner).__name__}.{function}"
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {function}"
        frame = frame.f_back
    return "unknown code"
