"""The doctor's report: a text table for people, JSON for programs."""

import math
import textwrap

__all__ = [
    "format_figure",
    "header",
    "table",
    "to_json",
]

_COLUMNS = (("probe", 22), ("checks", 36), ("stock Keras", 26), ("SafeDistributedModel", 26), ("verdict", 8))

_CELL_LIMIT = 100


def format_figure(figure):
    """A figure as table text: 4 significant digits, scientific when tiny."""
    if isinstance(figure, bool) or not isinstance(figure, float):
        return str(figure)
    if figure != 0.0 and math.isfinite(figure) and abs(figure) < 1e-3:
        return f"{figure:.1e}"
    return f"{figure:.4g}"


def header(versions, replicas):
    """One line: the versions and the number of replicas."""
    return (
        f"keras-safe-dist doctor: Python {versions['python']}, Keras {versions['keras']}, "
        f"TensorFlow {versions['tensorflow']}, keras_safe_dist {versions['keras_safe_dist']}; "
        f"{replicas} replicas (logical CPU devices)"
    )


def table(versions, replicas, results, with_header=True):
    """The report as a fixed-width text table with wrapped cells and a summary line.

    Args:
        versions: as returned by `versions()`.
        replicas: the number of replicas the probes ran on.
        results: a list of `Result`.
        with_header: start with the `header()` line.
    """
    rows = [[name for name, _ in _COLUMNS]]
    for result in results:
        rows.append([
            result.probe.name,
            result.probe.checks,
            _cell(result.stock, "defect"),
            _cell(result.safe, "FAIL"),
            result.verdict,
        ])
    widths = [width for _, width in _COLUMNS]
    rule = "+-" + "-+-".join("-" * width for width in widths) + "-+"
    lines = [header(versions, replicas), "", rule] if with_header else [rule]
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
    lines.append(_summary(results))
    return "\n".join(lines)


def to_json(versions, replicas, results):
    """The report as JSON-ready data: versions, replicas and one entry per probe."""
    return {
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


def _cell(side, bad):
    label = {True: "ok", False: bad, None: "skipped"}[side.ok]
    figure = format_figure(side.figure)
    if len(figure) > _CELL_LIMIT:
        figure = figure[: _CELL_LIMIT - 3] + "..."  # the JSON has all of it
    return figure if side.ok is None else f"{label}: {figure}"


def _side_json(side):
    figure = side.figure
    if isinstance(figure, float) and not math.isfinite(figure):
        figure = str(figure)  # JSON has no NaN or infinity
    return {"ok": side.ok, "figure": figure}


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
