"""What a doctor run produces on any backend: each probe's `Result`, the verdicts, the exit status.

Nothing here imports a backend: the TensorFlow runner (`runner.py`) and the
JAX one (`jax/runner.py`) both collect their probes' sides into `Result`s.
"""

import dataclasses
import sys
import time

from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side

__all__ = [
    "NotApplicable",
    "Result",
    "choose",
    "exit_status",
    "print_progress",
    "run_probes",
]


@dataclasses.dataclass(frozen=True)
class Result:
    """A probe's two sides and how long it took."""

    probe: Probe
    stock: Side
    safe: Side
    seconds: float

    @property
    def verdict(self):
        """`FAIL`, `skipped`, `fixed` (stock shows the defect) or `stock ok`."""
        if self.safe.ok is False:
            return "FAIL"
        if self.safe.ok is None:
            return "skipped"
        return "fixed" if self.stock.ok is False else "stock ok"


@dataclasses.dataclass(frozen=True)
class NotApplicable:
    """A probe of another backend that has no meaning on this one, and why."""

    name: str
    reason: str

    def to_json(self):
        return {"name": self.name, "reason": self.reason}


def choose(probes, names=None, not_applicable=()):
    """The probes named in `names` (all when None), in the order of `probes`.

    Raises:
        ValueError: for an unknown name, listing the available ones (and
            saying why a name of `not_applicable` does not run here).
    """
    if not names:
        return list(probes)
    known = {probe.name for probe in probes}
    unknown = [name for name in names if name not in known]
    if unknown:
        why = {entry.name: entry.reason for entry in not_applicable}
        notes = "".join(f" {name} is not applicable here: {why[name]}" for name in unknown if name in why)
        raise ValueError(
            f"Unknown probe name(s): {', '.join(unknown)}. "
            f"Available: {', '.join(probe.name for probe in probes)}. "
            f"Pass names from that list to --only.{notes}"
        )
    return [probe for probe in probes if probe.name in names]


def run_probes(probes, strategy, progress=None):
    """Runs each probe as `probe.run(strategy)`; `progress(index, total, probe, result)` before (None) and after.

    Returns:
        A list of `Result`, one per probe.
    """
    results = []
    for index, probe in enumerate(probes):
        if progress is not None:
            progress(index, len(probes), probe, None)
        start = time.perf_counter()
        stock, safe = probe.run(strategy)
        result = Result(probe, stock, safe, time.perf_counter() - start)
        results.append(result)
        if progress is not None:
            progress(index, len(probes), probe, result)
    return results


def exit_status(results):
    """0 when SafeDistributedModel passed every probe that ran, else 1."""
    return 1 if any(result.safe.ok is False for result in results) else 0


def print_progress(index, total, probe, result):
    """`[1/5] name ...` before a probe and `[1/5] name: verdict (N s)` after it, on stderr."""
    prefix = f"[{index + 1}/{total}] {probe.name}"
    if result is None:
        print(f"{prefix} ...", file=sys.stderr, flush=True)
    else:
        print(f"{prefix}: {result.verdict} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)
