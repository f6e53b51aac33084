"""Reading back what the callbacks wrote into a log directory.

`read_log_dir` gathers the audit reports (`audit_<name>.json`), the NaN onset
reports (`nan_onset.json`, one per run) and, from TensorBoard event files, the
update statistics of each run (`safe_distributed/<name>` from `Dashboard`, or
`epoch_<name>` from `keras.callbacks.TensorBoard`). `keras-safe-dist report`
prints it and gates on the findings.

It imports neither TensorFlow nor Keras: event files are read with the
`tensorboard` package's own record reader and protocol buffers.
"""

import dataclasses
import json
import os
import stat
import struct

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as _masked_crc32c
from tensorboard.util import tensor_util

from keras_safe_dist.findings import SEVERITIES
from keras_safe_dist.findings import AuditReport
from keras_safe_dist.findings import Finding
from keras_safe_dist.findings import markdown_row
from keras_safe_dist.update.statistics import LOG_NAMES
from keras_safe_dist.update.statistics import PREFIX
from keras_safe_dist.update.statistics import RUN as DASHBOARD_RUN

__all__ = ["LogDirReport", "RunStatistics", "UnreadableFile", "format_text", "read_log_dir"]

NAN_ONSET_FILE = "nan_onset.json"


@dataclasses.dataclass
class UnreadableFile:
    """A file `read_log_dir` could not read, and why.

    Args:
        path: the file's path.
        problem: what went wrong, in one line.

    Example:

    ```python
    report = read_log_dir("logs")
    for unreadable in report.errors + report.warnings:
        print(unreadable.path, unreadable.problem)
    ```
    """

    path: str
    problem: str


@dataclasses.dataclass
class RunStatistics:
    """The update statistics one TensorBoard run logged, per epoch.

    Args:
        run: the run's folder, relative to the log directory (`.` for the
            root).
        values: `{statistic: [value per logged epoch]}`, or per logged
            update when the run logged no epoch (it stopped in its first).
        per: `"epoch"`, or `"update"` for the Dashboard's per-update points.
        notes: what the reader noticed about the run's files (two writers
            at once).

    Example:

    ```python
    for run in read_log_dir("logs").runs:
        print(run.run, run.summary()["grad_norm"]["max"])
    ```
    """

    run: str
    values: dict
    per: str = "epoch"
    notes: list = dataclasses.field(default_factory=list)

    def summary(self):
        """`{statistic: {"last", "max", "mean"}}` over the logged epochs (or updates).

        Returns:
            A dict: for each statistic, a dict of its last, largest and mean
            value.
        """
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
    """Everything `read_log_dir` found.

    Args:
        log_dir: the directory read.
        audits: the `AuditReport`s.
        nan_onsets: `(run, report)` for each `nan_onset.json`, `run` being
            its folder relative to `log_dir`.
        runs: the `RunStatistics` of each run that logged update statistics.
        errors: the `UnreadableFile`s among the reports (audit and NaN onset
            JSON files): what they held is missing from the findings.
        warnings: the `UnreadableFile`s among the event files: the values
            read before the damage are kept.

    Example:

    ```python
    report = read_log_dir("logs")
    for finding in report.failing("warning"):
        print(finding.code, finding.subject)
    ```
    """

    log_dir: str
    audits: list
    nan_onsets: list
    runs: list
    errors: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)

    def findings(self):
        """The audit findings, plus `NAN001` for each NaN onset.

        Returns:
            A list of `Finding`s, the audits' first, in the order read.
        """
        findings = [f for _, f in _one_jax001(self._audit_findings())]
        for _, onset in self.nan_onsets:
            findings += _nan_findings(onset)
        return findings

    def _audit_findings(self):
        return [(audit.name, f) for audit in self.audits for f in audit.findings]

    def failing(self, fail_on):
        """The findings of severity `fail_on` or worse.

        Args:
            fail_on: `"error"`, `"warning"` or `"info"`.

        Returns:
            A list of `Finding`s.

        Raises:
            ValueError: when `fail_on` is not one of those severities.
        """
        if fail_on not in SEVERITIES:
            raise ValueError(
                f"`fail_on` must be one of {', '.join(repr(s) for s in SEVERITIES)}. "
                f"Received: fail_on={fail_on!r}"
            )
        worst = SEVERITIES.index(fail_on)
        return [f for f in self.findings() if SEVERITIES.index(f.severity) <= worst]

    def to_dict(self, fail_on="error"):
        """The report as JSON-ready data, what `keras-safe-dist report --json` prints.

        Args:
            fail_on: the severity at or above which a finding fails the
                report: `"error"`, `"warning"` or `"info"`.

        Returns:
            A dict with the keys `log_dir`, `audits`, `nan_onsets`, `runs`,
            `errors`, `warnings`, `counts` (findings per severity),
            `fail_on` and `failed`.

        Raises:
            ValueError: when `fail_on` is not one of those severities.
        """
        counts = dict.fromkeys(SEVERITIES, 0)
        for finding in self.findings():
            counts[finding.severity] += 1
        return {
            "log_dir": self.log_dir,
            "audits": [report.to_dict() for report in self.audits],
            "nan_onsets": [{"run": run, **onset} for run, onset in self.nan_onsets],
            "runs": [
                {"run": r.run, "per": r.per, "statistics": r.summary(), "notes": list(r.notes)}
                for r in self.runs
            ],
            "errors": [dataclasses.asdict(e) for e in self.errors],
            "warnings": [dataclasses.asdict(w) for w in self.warnings],
            "counts": counts,
            "fail_on": fail_on,
            "failed": bool(self.failing(fail_on)),
        }


def read_log_dir(log_dir):
    """Reads the reports and statistics written under `log_dir`.

    A report file that cannot be read (not JSON, truncated, not the shape
    the callbacks write, nested too deeply, not a regular file) lands in
    `errors`, a damaged event file (or one that is not a regular file) in
    `warnings`; neither stops the rest from being read. Only regular files
    are opened: a FIFO would wait for a writer. Every subfolder is
    read: each `audit_<name>.json`, each `nan_onset.json` and the event
    files of each run.

    Args:
        log_dir: the log directory given to the callbacks, a str or an
            `os.PathLike`.

    Returns:
        A `LogDirReport`.

    Raises:
        FileNotFoundError: when `log_dir` does not exist.
        NotADirectoryError: when `log_dir` is a file.
        TypeError: when `log_dir` is not a path (`os.fspath` refuses it).

    Example:

    ```python
    report = keras_safe_dist.report.read_log_dir("logs")
    print(len(report.findings()), "findings in", len(report.audits), "audit reports")
    ```
    """
    log_dir = os.fspath(log_dir)
    if os.path.isfile(log_dir):
        raise NotADirectoryError(
            f"{log_dir} is a file; report reads the log directory given to the "
            f"callbacks (here perhaps {os.path.dirname(log_dir) or '.'})"
        )
    if not os.path.isdir(log_dir):
        raise FileNotFoundError(
            f"log directory not found: {log_dir!r}. Pass the log_dir given to the "
            "callbacks (NaNOnsetDetector, the audits, Dashboard), as it is seen from "
            f"here (the working directory is {os.getcwd()})"
        )
    report = LogDirReport(log_dir, [], [], [])
    for folder, _, files in sorted(os.walk(log_dir)):
        run = os.path.relpath(folder, log_dir)
        for name in sorted(files):
            path = os.path.join(folder, name)
            if name.startswith("audit_") and name.endswith(".json"):
                audit = _read_json(path, AuditReport.from_dict, report.errors)
                if audit is not None:
                    report.audits.append(audit)
            elif name == NAN_ONSET_FILE:
                onset = _read_json(path, _checked_onset, report.errors)
                if onset is not None:
                    report.nan_onsets.append((run, onset))
        events = []
        for name in sorted(files):
            path = os.path.join(folder, name)
            if ".tfevents." not in name:
                continue
            if os.path.isfile(path):
                events.append(path)
            else:
                report.warnings.append(UnreadableFile(path, _NOT_REGULAR))
        values, per, notes = _run_statistics(events, report.warnings)
        if values:
            report.runs.append(RunStatistics(run, values, per, notes))
    report.runs = _each_statistic_once(report.runs)
    return report


def _each_statistic_once(runs):
    """Drops what a Dashboard run beside a run (Keras's `train`) already holds.

    `Dashboard` and `keras.callbacks.TensorBoard` given the same log
    directory log the same statistics, in sibling runs.
    """
    dashboards = {
        os.path.dirname(r.run): r.values
        for r in runs
        if os.path.basename(r.run) == DASHBOARD_RUN
    }
    kept = []
    for run in runs:
        beside = dashboards.get(os.path.dirname(run.run))
        if beside is not None and os.path.basename(run.run) != DASHBOARD_RUN:
            run = dataclasses.replace(
                run, values={k: v for k, v in run.values.items() if k not in beside}
            )
        if run.values:
            kept.append(run)
    return kept


_NOT_REGULAR = "not a regular file (a FIFO, socket, device or folder), so not opened"


def _read_json(path, parse, errors):
    """`parse(json)` of the file at `path`, or None with the problem added to `errors`.

    Only a regular file is read: opening a FIFO would wait for a writer.
    """
    try:
        text = _read_regular_file(path)
    except _NotRegular:
        errors.append(UnreadableFile(path, _NOT_REGULAR))
        return None
    except (OSError, UnicodeDecodeError) as error:
        errors.append(UnreadableFile(path, f"not readable as JSON ({error})"))
        return None
    try:
        return parse(json.loads(text))
    except json.JSONDecodeError as error:
        errors.append(UnreadableFile(path, f"not readable as JSON ({error})"))
    except RecursionError:
        errors.append(
            UnreadableFile(path, "JSON nested too deeply to be a report keras_safe_dist writes")
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        errors.append(
            UnreadableFile(path, f"JSON not of the shape keras_safe_dist writes ({error!r})")
        )
    return None


class _NotRegular(Exception):
    pass


def _read_regular_file(path):
    """The text of the regular file at `path`; raises `_NotRegular` for anything else."""
    # Non-blocking, so that opening a FIFO returns at once; then checked.
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(descriptor, "rb") as f:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise _NotRegular(path)
        return f.read().decode("utf-8")


def _checked_onset(data):
    """`data` if it has the shape of the reports `NaNOnsetDetector` writes."""
    if not isinstance(data, dict):
        raise TypeError(f"expected an object, received {type(data).__name__}")
    wrong = [
        key
        for key, kind in (("epoch", int), ("batch", int), ("kind", str))
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool)
    ]
    if wrong:
        raise ValueError(
            "a NaN onset report holds `epoch` and `batch` (integers) and `kind` "
            f"(a string); missing or wrong: {', '.join(wrong)}"
        )
    _nan_findings(data)  # raises for a malformed stored finding
    return data


def _run_statistics(paths, warnings):
    """`(values, per, notes)` of one run's event files.

    `values` is `{statistic: [value per logged epoch]}`; values of
    `safe_distributed/<name>` (the Dashboard's) are preferred to
    `epoch_<name>` (keras.callbacks.TensorBoard's) for the same statistic.
    A run that logged no epoch (it stopped in its first) gives the
    Dashboard's per-update points instead, with `per` `"update"`. `notes`
    says when two files of the run were written at the same time (two runs
    with one log directory and run name), whose points are then merged.
    """
    series = {}  # tag: [value, ...]
    epoch_tags = {f"{PREFIX}/{n}" for n in LOG_NAMES} | {f"epoch_{n}" for n in LOG_NAMES}
    update_tags = {f"{PREFIX}/update/{n}" for n in LOG_NAMES}
    spans = []  # (first, last wall time, path) of each file with statistics
    for path in paths:
        times = []
        try:
            for event in _events(path):
                for value in event.summary.value:
                    if value.tag in epoch_tags or value.tag in update_tags:
                        series.setdefault(value.tag, []).append(_scalar(value))
                        times.append(event.wall_time)
        except (OSError, ValueError, DecodeError) as error:
            warnings.append(UnreadableFile(path, f"event file damaged, read up to it: {error}"))
        if times:
            spans.append((min(times), max(times), path))
    values, per = {}, "epoch"
    for name in LOG_NAMES:
        for tag in (f"{PREFIX}/{name}", f"epoch_{name}"):
            if tag in series:
                values[name] = series[tag]
                break
    if not values:
        per = "update"
        values = {n: series[f"{PREFIX}/update/{n}"] for n in LOG_NAMES if f"{PREFIX}/update/{n}" in series}
    notes = []
    spans.sort()
    latest = None  # (end, path) of the file written last among those before
    for start, end, path in spans:
        if latest is not None and start < latest[0]:
            notes.append(
                f"two writers overlapped: {os.path.basename(latest[1])} and "
                f"{os.path.basename(path)} were written at the same time (two runs with "
                "one log directory and run name?); their points are merged"
            )
        if latest is None or end > latest[0]:
            latest = (end, path)
    return values, per, notes


def _events(path):
    """The events of the event file `path`, each record's CRC-32Cs checked.

    Read with `open()`, so that any name the file system holds is read
    (TensorBoard's TensorFlow-free reader encodes the path as UTF-8, which a
    folder named in another encoding is not). Raises `ValueError` at a
    truncated or damaged record, after the events before it.
    """
    with open(path, "rb") as f:
        while True:
            offset = f.tell()
            header = f.read(12)
            if not header:
                return
            length_bytes = header[:8]
            if len(header) < 12:
                raise ValueError(f"{path}: record truncated at byte {offset} (header)")
            if _masked_crc32c(length_bytes) != struct.unpack("<I", header[8:])[0]:
                raise ValueError(f"{path}: record at byte {offset} failed its header crc32 check")
            (length,) = struct.unpack("<Q", length_bytes)
            data, crc = f.read(length), f.read(4)
            if len(data) < length or len(crc) < 4:
                raise ValueError(f"{path}: record truncated at byte {offset} (data)")
            if _masked_crc32c(data) != struct.unpack("<I", crc)[0]:
                raise ValueError(f"{path}: record at byte {offset} failed its data crc32 check")
            yield event_pb2.Event.FromString(data)


def _scalar(value):
    if value.HasField("tensor"):
        return float(tensor_util.make_ndarray(value.tensor))
    return float(value.simple_value)


def _one_jax001(pairs):
    """`(audit, finding)` pairs with every `JAX001` (one per audit on JAX) merged into one.

    Each audit callback says on JAX which of its checks ran; a run with
    several of them gets one row naming them all, where the first stood.
    """
    notes = [(audit, f) for audit, f in pairs if f.code == "JAX001"]
    if len(notes) < 2:
        return list(pairs)
    merged = Finding.of(
        "JAX001",
        "the audits on JAX",
        " ".join(f.message for _, f in notes),
        notes[0][1].fix,
    )
    audits = ", ".join(dict.fromkeys(audit for audit, _ in notes))
    result = []
    for audit, f in pairs:
        if f.code != "JAX001":
            result.append((audit, f))
        elif not any(r[1].code == "JAX001" for r in result):
            result.append((audits, merged))
    return result


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
    findings = _one_jax001(report._audit_findings())
    for run, onset in report.nan_onsets:
        label = "nan onset" if run == "." else f"nan onset ({run})"
        findings += [(label, f) for f in _nan_findings(onset)]
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
        first = _nan_findings(onset)[0]
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
