"""The doctor's report: a text table for people, JSON for programs."""

import math
import textwrap

from keras_safe_dist.core import _json

__all__ = [
    "format_figure",
    "header",
    "table",
    "to_json",
]

# The table fits 100 columns: 2 + 22 + 3 + 31 + 3 + 26 + 3 + 8 + 2. Each probe's
# `checks` text is too long for a cell; it is listed below the table.
_COLUMNS = (("probe", 22), ("stock Keras", 31), ("SafeDistributedModel", 26), ("verdict", 8))

_LINE_LIMIT = 100

_CELL_LIMIT = 120


def format_figure(figure):
    """A figure as table text: 4 significant digits, scientific when tiny."""
    if isinstance(figure, bool) or not isinstance(figure, float):
        return str(figure)
    if figure != 0.0 and math.isfinite(figure) and abs(figure) < 1e-3:
        return f"{figure:.1e}"
    return f"{figure:.4g}"


_BACKENDS = {
    # backend: (its name in the versions line, what the replicas are)
    "tensorflow": ("TensorFlow", "replicas (logical CPU devices)"),
    "jax": ("JAX", "devices (JAX CPU devices, keras.distribution.DataParallel)"),
}


def header(versions, replicas, backend="tensorflow"):
    """Two lines of at most 100 characters: the number of replicas, then the versions.

    Args:
        versions: as returned by the backend's `versions()`: `python`,
            `keras`, the backend's own (`tensorflow` or `jax`) and
            `keras_safe_dist`.
        replicas: the number of replicas (devices) the probes ran on.
        backend: `"tensorflow"` or `"jax"`.
    """
    name, devices = _BACKENDS[backend]
    lines = [
        f"keras-safe-dist doctor: {replicas} {devices}",
        f"Python {versions['python']}, Keras {versions['keras']}, "
        f"{name} {versions[backend]}, keras_safe_dist {versions['keras_safe_dist']}",
    ]
    return "\n".join(_wrap(line) for line in lines)


def table(
    versions, replicas, results, with_header=True, backend="tensorflow", not_applicable=()
):
    """The report as text of at most 100 columns: a table, what each probe checks, a summary.

    The table has a row per probe (its stock and SafeDistributedModel cells
    and the verdict, wrapped); below it each probe's `checks` text (what it
    measures and what its figure is) is listed as `name: text`, followed by
    the numeric figures it measured (`; measured: stock 0.3507,
    SafeDistributedModel 3.3e-08`), wrapped; the last line is the summary.

    Args:
        versions: as returned by `versions()`.
        replicas: the number of replicas the probes ran on.
        results: a list of `Result`.
        with_header: start with the `header()` lines and a blank line.
        backend: `"tensorflow"` or `"jax"`, for the header.
        not_applicable: `NotApplicable` entries, listed with their reasons
            above the summary.

    Returns:
        The report as one string, lines separated by newlines.
    """
    rows = [[name for name, _ in _COLUMNS]]
    for result in results:
        rows.append([
            result.probe.name,
            _cell(result.stock, "defect"),
            _cell(result.safe, "FAIL"),
            result.verdict,
        ])
    widths = [width for _, width in _COLUMNS]
    rule = "+-" + "-+-".join("-" * width for width in widths) + "-+"
    lines = [header(versions, replicas, backend), "", rule] if with_header else [rule]
    for number, row in enumerate(rows):
        wrapped = [textwrap.wrap(text, width) or [""] for text, width in zip(row, widths)]
        for i in range(max(len(cell) for cell in wrapped)):
            parts = [
                (cell[i] if i < len(cell) else "").ljust(width)
                for cell, width in zip(wrapped, widths)
            ]
            lines.append("| " + " | ".join(parts) + " |")
        if number == 0 or number == len(rows) - 1:
            lines.append(rule)
    if results:
        lines += ["", "What each probe checks, and the figures it measured:"]
        lines += [
            _wrap(
                f"{result.probe.name}: {result.probe.checks}{_measured(result)}",
                first="  ", indent="    ",
            )
            for result in results
        ]
        lines.append("")
    if not_applicable:
        lines.append(f"Not applicable on {_BACKENDS[backend][0]}:")
        lines += [
            _wrap(f"{entry.name}: {entry.reason}", first="  ", indent="    ")
            for entry in not_applicable
        ]
        lines.append("")
    lines.append(_wrap(_summary(results)))
    return "\n".join(lines)


def to_json(versions, replicas, results, backend="tensorflow", not_applicable=()):
    """The report as JSON-ready data: the backend, versions, replicas and one entry per probe.

    A JAX report also lists the probes that do not apply there, with the
    reason, under `not_applicable`.
    """
    document = {
        "backend": backend,
        "versions": dict(versions),
        "replicas": replicas,
        "probes": [
            {
                "name": result.probe.name,
                "checks": result.probe.checks,
                "stock": _side_json(result.stock),
                "safe": _side_json(result.safe),
                "verdict": result.verdict,
                "seconds": round(result.seconds, 2),
            }
            for result in results
        ],
    }
    if not_applicable:
        document["not_applicable"] = [entry.to_json() for entry in not_applicable]
    return document


def _wrap(text, first="", indent=""):
    """`text` wrapped to `_LINE_LIMIT` columns; `first` and `indent` start its lines."""
    lines = textwrap.wrap(text, _LINE_LIMIT, initial_indent=first, subsequent_indent=indent)
    return "\n".join(lines)


def _cell(side, bad):
    label = {True: "ok", False: bad, None: "skipped"}[side.ok]
    figure = format_figure(side.figure)
    if len(figure) > _CELL_LIMIT:
        # At a word boundary; the JSON has all of it.
        figure = figure[: _CELL_LIMIT - 3].rsplit(" ", 1)[0] + " ..."
    return figure if side.ok is None else f"{label}: {figure}"


def _measured(result):
    """`; measured: stock 0.3507, SafeDistributedModel 3.3e-08`: the numeric figures, beside their meaning.

    A side whose figure is an error or a skip reason is left out: its cell
    holds all of it.
    """
    numbers = [
        f"{name} {format_figure(side.figure)}"
        for name, side in (("stock", result.stock), ("SafeDistributedModel", result.safe))
        if isinstance(side.figure, (int, float)) and not isinstance(side.figure, bool)
    ]
    return f"; measured: {', '.join(numbers)}" if numbers else ""


def _side_json(side):
    # JSON has no NaN or infinity: the project's strings stand for them.
    return {"ok": side.ok, "figure": _json.strict(side.figure)}


def _summary(results):
    ran = [r for r in results if r.safe.ok is not None]
    passed = sum(r.safe.ok is True for r in ran)
    fixed = sum(r.verdict == "fixed" for r in results)
    skipped = len(results) - len(ran)
    text = (
        f"SafeDistributedModel passed {passed} of {len(ran)} probes; stock Keras showed "
        f"the defect in {fixed}."
    )
    return text + (f" {skipped} skipped." if skipped else "")
