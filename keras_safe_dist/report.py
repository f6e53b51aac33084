"""Reading back what the callbacks wrote into a log directory.

`read_log_dir` gathers the audit reports (`audit_<name>.json`), the NaN onset
report (`nan_onset.json`) and, from TensorBoard event files, the update
statistics of each run (`safe_distributed/<name>` from `Dashboard`, or
`epoch_<name>` from `keras.callbacks.TensorBoard`). `keras-safe-dist report`
prints it and gates on the findings.
"""

import dataclasses
import json
import os

import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from keras_safe_dist.callbacks.dashboard import PREFIX
from keras_safe_dist.callbacks.dashboard import STATISTICS
from keras_safe_dist.findings import SEVERITIES
from keras_safe_dist.findings import AuditReport
from keras_safe_dist.findings import Finding

__all__ = ["LogDirReport", "RunStatistics", "format_text", "read_log_dir"]

NAN_ONSET_FILE = "nan_onset.json"


@dataclasses.dataclass
class RunStatistics:
    """The update statistics one TensorBoard run logged, per epoch.

    Attributes:
        run: the run's folder, relative to the log directory (`.` for the
            root).
        values: `{statistic: [value per logged epoch]}`.
    """

    run: str
    values: dict

    def summary(self):
        """`{statistic: {"last", "max", "mean"}}` over the logged epochs."""
        return {
            name: {
                "last": series[-1],
                "max": max(series),
                "mean": sum(series) / len(series),
            }
            for name, series in self.values.items()
        }


@dataclasses.dataclass
class LogDirReport:
    """Everything `read_log_dir` found."""

    log_dir: str
    audits: list
    nan_onset: dict
    runs: list

    def findings(self):
        """The audit findings, plus `NAN001` for a NaN onset."""
        findings = [f for report in self.audits for f in report.findings]
        if self.nan_onset is not None:
            findings += _nan_findings(self.nan_onset)
        return findings

    def failing(self, fail_on):
        """The findings of severity `fail_on` or worse."""
        worst = SEVERITIES.index(fail_on)
        return [f for f in self.findings() if SEVERITIES.index(f.severity) <= worst]

    def to_dict(self, fail_on="error"):
        counts = dict.fromkeys(SEVERITIES, 0)
        for finding in self.findings():
            counts[finding.severity] += 1
        return {
            "log_dir": self.log_dir,
            "audits": [report.to_dict() for report in self.audits],
            "nan_onset": self.nan_onset,
            "runs": [{"run": r.run, "statistics": r.summary()} for r in self.runs],
            "counts": counts,
            "fail_on": fail_on,
            "failed": bool(self.failing(fail_on)),
        }


def read_log_dir(log_dir):
    """Reads the reports and statistics written under `log_dir`.

    Raises:
        FileNotFoundError: when `log_dir` is not a directory.
    """
    if not os.path.isdir(log_dir):
        raise FileNotFoundError(f"log directory not found: {log_dir}")
    audits, nan_onset, runs = [], None, []
    for folder, _, files in sorted(os.walk(log_dir)):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if name.startswith("audit_") and name.endswith(".json"):
                with open(path) as f:
                    audits.append(AuditReport.from_dict(json.load(f)))
            elif name == NAN_ONSET_FILE and nan_onset is None:
                with open(path) as f:
                    nan_onset = json.load(f)
        if any(".tfevents." in name for name in files):
            run = _run_statistics(log_dir, folder)
            if run.values:
                runs.append(run)
    return LogDirReport(os.fspath(log_dir), audits, nan_onset, runs)


def _run_statistics(log_dir, folder):
    accumulator = event_accumulator.EventAccumulator(
        folder, size_guidance={"tensors": 0, "scalars": 0}
    )
    accumulator.Reload()
    tags = accumulator.Tags()
    values = {}
    for name in STATISTICS:
        for tag in (f"{PREFIX}/{name}", f"epoch_{name}"):
            if tag in tags.get("tensors", ()):
                events = accumulator.Tensors(tag)
                values[name] = [_scalar(e.tensor_proto) for e in events]
                break
            if tag in tags.get("scalars", ()):
                values[name] = [e.value for e in accumulator.Scalars(tag)]
                break
    return RunStatistics(os.path.relpath(folder, log_dir), values)


def _scalar(proto):
    return float(tf.make_ndarray(proto))


def _nan_findings(onset):
    """NAN001 for the onset, and NAN002 when training stopped on skips.

    Uses the findings `NaNOnsetDetector` stored in the report, or builds
    NAN001 from the report's fields.
    """
    findings = [
        Finding(**onset["finding"]) if "finding" in onset else _nan_finding(onset)
    ]
    if "skips" in onset:
        findings.append(Finding(**onset["skips"]))
    return findings


def _nan_finding(onset):
    where = f"epoch {onset.get('epoch')}, batch {onset.get('batch')}"
    layer = onset.get("layer")
    detail = f"first non-finite {onset.get('kind', 'value')}"
    if layer:
        detail += f", first in layer '{layer}'"
    if onset.get("replica") is not None:
        detail += f", on replica {onset['replica']}"
    return Finding.of(
        "NAN001",
        where,
        f"{detail}.",
        "Inspect nan_onset_batch.npz and the layer named; see nan_onset.json.",
    )


def format_text(report, fail_on="error"):
    """The report as the text `keras-safe-dist report` prints."""
    data = report.to_dict(fail_on)
    counts = ", ".join(f"{n} {sev}" for sev, n in data["counts"].items())
    lines = [f"Log directory: {report.log_dir}", "", f"Findings ({counts}):"]
    findings = [
        (audit.name, f) for audit in report.audits for f in audit.findings
    ]
    if report.nan_onset is not None:
        findings += [("nan onset", f) for f in _nan_findings(report.nan_onset)]
    if findings:
        lines += [
            "| audit | code | severity | subject | message | fix |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for audit, f in findings:
            lines.append(
                f"| {audit} | {f.code} | {f.severity} | {f.subject} | "
                f"{f.message} | {f.fix} |"
            )
    else:
        lines.append(f"none ({len(report.audits)} audit reports read)")
    lines += ["", "NaN onset:"]
    if report.nan_onset is None:
        lines.append("none recorded")
    else:
        onset = report.nan_onset
        first = _nan_findings(onset)[0]
        lines.append(onset.get("summary") or f"{first.subject}: {first.message}")
    lines += ["", "Update statistics per run:"]
    if report.runs:
        lines += [
            "| run | statistic | last | max | mean |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for run in report.runs:
            for name, s in run.summary().items():
                lines.append(
                    f"| {run.run} | {name} | {s['last']:.4g} | {s['max']:.4g} "
                    f"| {s['mean']:.4g} |"
                )
    else:
        lines.append("none logged")
    failing = report.failing(fail_on)
    lines += [
        "",
        f"{len(failing)} finding(s) at or above '{fail_on}'"
        + (": failing." if failing else "."),
    ]
    return "\n".join(lines)
