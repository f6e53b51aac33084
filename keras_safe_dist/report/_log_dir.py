"""Reading back what the callbacks wrote into a log directory.

`read_log_dir` gathers the audit reports (`audit_<name>.json`), the NaN onset
reports (`nan_onset.json`, one per run) and, from TensorBoard event files, the
update statistics of each run (`safe_distributed/<name>` from `Dashboard`, or
`epoch_<name>` from `keras.callbacks.TensorBoard`). `keras-safe-dist report`
prints it and gates on the findings.

It imports neither TensorFlow nor Keras: event files are read with the
`tensorboard` package's own record reader and protocol buffers. A remote log
directory (`gs://...`) is read through TensorFlow's `tf.io.gfile`, the one
case that needs TensorFlow (as for writing there).
"""

import dataclasses
import json
import os
import stat

from keras_safe_dist.core import _files
from keras_safe_dist.findings import SEVERITIES
from keras_safe_dist.findings import AuditReport
from keras_safe_dist.findings import Finding
from keras_safe_dist.report import _statistics

__all__ = ["LogDirReport", "UnreadableFile", "nan_findings", "read_log_dir"]

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
        return [f for _, f in self.labelled_findings()]

    def labelled_findings(self):
        """Each finding of `findings()` with where it comes from, in the same order.

        Returns:
            A list of `(label, Finding)`: the audit's name (the audits on
            JAX share one `JAX001`, labelled with all their names), or
            `"nan onset"` (`"nan onset (<run>)"` for a run in a subfolder).
        """
        pairs = _one_jax001([(audit.name, f) for audit in self.audits for f in audit.findings])
        for run, onset in self.nan_onsets:
            label = "nan onset" if run == "." else f"nan onset ({run})"
            pairs += [(label, f) for f in nan_findings(onset)]
        return pairs

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
            `os.PathLike`; a remote one (`gs://...`) is read through
            `tf.io.gfile`, which needs TensorFlow.

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
    remote = _files.remote(log_dir)
    if not _files.isdir(log_dir):  # one lookup: a round trip on a remote file system
        if _files.exists(log_dir):
            raise NotADirectoryError(
                f"{log_dir} is a file; report reads the log directory given to the "
                f"callbacks (here perhaps {os.path.dirname(log_dir) or '.'})"
            )
        seen_from = "" if remote else f" (the working directory is {os.getcwd()})"
        raise FileNotFoundError(
            f"log directory not found: {log_dir!r}. Pass the log_dir given to the "
            "callbacks (NaNOnsetDetector, the audits, Dashboard), as it is seen from "
            f"here{seen_from}"
        )
    report = LogDirReport(log_dir, [], [], [])
    for folder, _, files in sorted(_files.walk(log_dir)):
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
            if remote or os.path.isfile(path):  # a remote file system has no FIFOs
                events.append(path)
            else:
                report.warnings.append(UnreadableFile(path, _NOT_REGULAR))
        values, per, notes, damaged = _statistics.run_statistics(events)
        report.warnings += [UnreadableFile(path, problem) for path, problem in damaged]
        if values:
            report.runs.append(_statistics.RunStatistics(run, values, per, notes))
    report.runs = _statistics.each_statistic_once(report.runs)
    return report


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
    if _files.remote(path):  # a remote file system has no FIFOs
        with _files.open_file(path, "rb") as f:
            return f.read().decode("utf-8")
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
    nan_findings(data)  # raises for a malformed stored finding
    return data


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


def nan_findings(onset):
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


