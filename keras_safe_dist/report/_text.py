"""The text `keras-safe-dist report` prints: the findings, the NaN onsets, the statistics per run."""

from keras_safe_dist.findings import markdown_row
from keras_safe_dist.report._log_dir import nan_findings

__all__ = ["format_text"]


def format_text(report, fail_on="error"):
    """The report as the text `keras-safe-dist report` prints.

    Sections: the findings as a markdown table, the NaN onsets, the update
    statistics per run (last, max, mean), the unreadable files, and a last
    line with the number of findings at or above `fail_on`.

    Args:
        report: a `LogDirReport`.
        fail_on: `"error"`, `"warning"` or `"info"`.

    Returns:
        A str of several lines.

    Raises:
        ValueError: when `fail_on` is not one of those severities.

    Example:

    ```python
    from keras_safe_dist.report import format_text, read_log_dir

    print(format_text(read_log_dir("logs"), fail_on="warning"))
    ```
    """
    data = report.to_dict(fail_on)
    counts = ", ".join(f"{n} {sev}" for sev, n in data["counts"].items())
    lines = [f"Log directory: {report.log_dir}", "", f"Findings ({counts}):"]
    findings = report.labelled_findings()
    if findings:
        lines += [
            "| audit | code | severity | subject | message | fix |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for audit, f in findings:
            lines.append(
                markdown_row((audit, f.code, f.severity, f.subject, f.message, f.fix))
            )
    else:
        lines.append(f"none ({len(report.audits)} audit reports read)")
    lines += ["", "NaN onset:"]
    if not report.nan_onsets:
        lines.append("none recorded")
    for run, onset in report.nan_onsets:
        first = nan_findings(onset)[0]
        prefix = "" if len(report.nan_onsets) == 1 else f"[{run}] "
        lines.append(prefix + (onset.get("summary") or f"{first.subject}: {first.message}"))
    lines += ["", "Update statistics per run:"]
    if report.runs:
        lines += [
            "| run | statistic | last | max | mean |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for run in report.runs:
            for name, s in run.summary().items():
                numbers = (_number(s[key]) for key in ("last", "max", "mean"))
                lines.append(markdown_row((run.run, name, *numbers)))
        for run in report.runs:
            if run.per == "update":
                lines.append(
                    f"[{run.run}] per update: the run logged no epoch (it stopped in its "
                    f"first); {max(len(v) for v in run.values.values())} update points."
                )
            lines += [f"[{run.run}] {note}." for note in run.notes]
    elif report.audits or report.nan_onsets:
        lines.append(
            "none logged: the update statistics come from a SafeDistributedModel "
            "(with a Dashboard, a NaNOnsetDetector or log_update_stats=True); a "
            "stock keras.Model logs none. See SafeDistributedModel.from_model()."
        )
    else:
        lines.append("none logged")
    for title, problems in (("Unreadable reports", report.errors), ("Skipped", report.warnings)):
        if problems:
            lines += ["", f"{title}:"] + [f"- {p.path}: {p.problem}" for p in problems]
    failing = report.failing(fail_on)
    lines += [
        "",
        f"{len(failing)} finding(s) at or above '{fail_on}'"
        + (": failing." if failing else "."),
    ]
    return "\n".join(lines)


def _number(value):
    """Counts as integers (`0`, not `0.0000e+00`), other values to 4 significant digits."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"
