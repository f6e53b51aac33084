"""The `Probe` record and the `Side` result each half of a probe returns.

A probe compares stock Keras with SafeDistributedModel on one known defect.
Its `run(strategy)` (on JAX, `run(distribution)`) returns two `Side`s:
whether that side behaved correctly and the number (or the error, in one
line) that shows it. `measure()` turns an exception into a result, so a
crash is reported, not raised.
"""

import dataclasses
import re
from collections.abc import Callable

__all__ = [
    "TOLERANCE",
    "Probe",
    "Side",
    "measure",
    "one_line",
]

# Relative deviation below which two float32 updates count as equal.
TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Side:
    """What one side (stock or safe) of a probe did.

    Args:
        ok: True when that side behaves correctly, False when it shows the
            defect (or, for SafeDistributedModel, fails), None when the probe
            was skipped.
        figure: the measured number, or the error (or skip reason) in one
            line.
    """

    ok: bool | None
    figure: float | int | str

    def __post_init__(self):
        # Accept NumPy scalars from measurements; store plain Python values.
        if self.ok is not None:
            object.__setattr__(self, "ok", bool(self.ok))
        if hasattr(self.figure, "item"):
            object.__setattr__(self, "figure", self.figure.item())

    def to_json(self):
        return {"ok": self.ok, "figure": self.figure}


@dataclasses.dataclass(frozen=True)
class Probe:
    """One known defect, checked on stock Keras and on SafeDistributedModel.

    Args:
        name: short slug, used by `keras-safe-dist doctor --only`.
        checks: what the probe checks and the unit of its figure.
        run: called as `run(strategy)` with a `MirroredStrategy` over the
            replicas (on JAX, the `keras.distribution.DataParallel` over the
            devices); returns `(stock, safe)`, two `Side`s.
    """

    name: str
    checks: str
    run: Callable

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", self.name or ""):
            raise ValueError(
                "`name` must be a lowercase slug such as 'uneven-split'. "
                f"Received: name={self.name!r}"
            )


def measure(side):
    """Calls `side()` (which returns a `Side`); an exception becomes `Side(False, error)`."""
    try:
        return side()
    except Exception as error:  # noqa: BLE001 - a crash is the measurement
        return Side(False, one_line(error))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NODE = re.compile(r"\{\{[^}]*\}\}\s*")
_PER_REPLICA = re.compile(r"PerReplica:\{.*\n\}", re.DOTALL)
# JAX's IndivisibleError: `NamedSharding(mesh=Mesh(...), spec=..., memory_kind=device)` -> `NamedSharding`
_SHARDING = re.compile(r"NamedSharding\(mesh=.*?memory_kind=\w+\)")
_KERAS_WRAPPER = re.compile(r"^Exception encountered when calling [^\n]*\n+")
# `<class 'tensorflow.python.distribute.values.PerReplica'>` -> `PerReplica`
_CLASS_REPR = re.compile(r"<class '(?:[\w]+\.)*(\w+)'>")
_LIMIT = 200


def one_line(error):
    """`Type: first line of the message`, without Keras's wrapper or dumped tensors."""
    text = _ANSI.sub("", str(error))
    text = _KERAS_WRAPPER.sub("", text.strip())
    text = _PER_REPLICA.sub("PerReplica", text)
    text = _SHARDING.sub("NamedSharding", text)
    text = _NODE.sub("", text)
    text = _CLASS_REPR.sub(r"\1", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    message = lines[0] if lines else ""
    sentence = re.match(r"(.+?\.)(\s|$)", message)
    if sentence and len(sentence.group(1)) >= 20:
        message = sentence.group(1)
    if len(message) > _LIMIT:
        message = message[: _LIMIT - 3] + "..."
    name = type(error).__name__
    return f"{name}: {message}" if message else name
