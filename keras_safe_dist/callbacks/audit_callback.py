"""The base of the audit callbacks: reporting, silencing and acting on findings."""

import collections.abc
import warnings

import keras

from keras_safe_dist.core import _validate
from keras_safe_dist.findings import CODES
from keras_safe_dist.report import writer
from keras_safe_dist.scale_out.distributed import is_chief
from keras_safe_dist.scale_out.distributed import strategy_of

__all__ = ["AuditCallback", "AuditError", "AuditWarning"]

_ON_FINDING = ("warn", "raise", "ignore")


class AuditWarning(UserWarning):
    """Warned by an audit callback with `on_finding="warn"`.

    The message is the report's summary line, then one line per new warning
    or error: `[code] severity subject: message Fix: fix`.

    Example:

    ```python
    import warnings

    # Turn the audits' warnings into exceptions, e.g. in a test.
    warnings.simplefilter("error", keras_safe_dist.callbacks.AuditWarning)
    ```
    """


class AuditError(RuntimeError):
    """Raised by an audit callback with `on_finding="raise"`.

    The message is the report's summary line, then one line per warning or
    error: `[code] severity subject: message Fix: fix`.

    Args:
        report: the `AuditReport` holding the findings.

    Attributes:
        report: the `AuditReport` holding the findings.

    Example:

    ```python
    audit = keras_safe_dist.callbacks.AggregationAudit(on_finding="raise")
    try:
        model.fit(x, y, callbacks=[audit])
    except keras_safe_dist.callbacks.AuditError as error:
        print(error.report.to_markdown())
    ```
    """

    def __init__(self, report):
        self.report = report
        super().__init__(describe(report))


class AuditCallback(keras.callbacks.Callback):
    """Runs checks at chosen moments of `fit()` and reports their findings.

    A report is written to `log_dir` (markdown table as TensorBoard text
    under `audits/<name>`, counts per severity as scalars, and
    `audit_<name>.json`), kept in `.report`, then acted on: `"warn"` issues
    one `AuditWarning` listing the warnings and errors, `"raise"` raises an
    `AuditError` when there is a warning or an error, `"ignore"` does
    neither. Within one `fit()`, a finding (its code and subject) is warned
    or raised once: a report published again acts only on findings it did
    not hold before. Findings of severity `info` are only reported.
    Subclasses that override `on_train_begin` call
    `super().on_train_begin(logs)`, which starts that record afresh.

    Args:
        log_dir: where to write the report; None writes nothing.
        on_finding: `"warn"`, `"raise"` or `"ignore"`.
        ignore: finding codes to drop, any iterable of str, e.g. `("MODE003",)`.

    Raises:
        ValueError: when `on_finding` is not `"warn"`, `"raise"` or
            `"ignore"`, or `ignore` holds a code not in `CODES` (the message
            lists the available codes).
        TypeError: when `ignore` is a single string or not an iterable of
            str, or `log_dir` is neither None, a str nor an `os.PathLike`.
        AuditError: from `fit()`, with `on_finding="raise"`, when a report
            holds a warning or an error not acted on before in that `fit()`.
        OSError: when training begins, for a `log_dir` the chief cannot
            create or write.

    Example:

    ```python
    from keras_safe_dist.audits import frozen_batch_norm_findings
    from keras_safe_dist.callbacks import AuditCallback
    from keras_safe_dist.findings import AuditReport


    class FrozenBatchNormAudit(AuditCallback):
        name = "frozen_batch_norm"

        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            findings = frozen_batch_norm_findings(self.model)
            self.publish(AuditReport(self.name, findings))


    model.fit(x, y, callbacks=[FrozenBatchNormAudit(log_dir="logs")])
    ```
    """

    name = None

    def __init__(self, log_dir=None, on_finding="warn", ignore=()):
        super().__init__()
        if on_finding not in _ON_FINDING:
            raise ValueError(
                f"`on_finding` must be one of {_ON_FINDING}. "
                f"Received: on_finding={on_finding!r}"
            )
        ignore = _finding_codes(ignore)
        self.log_dir = _validate.optional_path("log_dir", log_dir)
        self.on_finding = on_finding
        self.ignore = ignore
        self.report = None
        self._acted_on = set()

    def on_train_begin(self, logs=None):
        self._acted_on = set()
        if self.log_dir is not None and is_chief(strategy_of(self.model)):
            # Before any training, rather than when the first report is written.
            _validate.writable_directory(type(self).__name__, "log_dir", self.log_dir)

    def publish(self, report, step=0, extra=None):
        """Keeps, writes and acts on `report`.

        Args:
            report: an `AuditReport`; codes in `ignore` are dropped first.
            step: the TensorBoard step to write at.
            extra: more JSON-ready data for `audit_<name>.json`.

        Raises:
            AuditError: with `on_finding="raise"`, when `report` holds a
                warning or an error (a code and subject) not acted on before
                in this `fit()`.
        """
        report = type(report)(report.name, report.findings, ignore=self.ignore)
        self.report = report
        if self.log_dir is not None:
            writer.write_report(
                self.log_dir,
                report,
                step,
                extra=extra,
                strategy=strategy_of(self.model),
                who=type(self).__name__,
            )
        serious = report.at_least("warning")
        new = [f for f in serious if (f.code, f.subject) not in self._acted_on]
        self._acted_on.update((f.code, f.subject) for f in serious)
        if not new or self.on_finding == "ignore":
            return
        if self.on_finding == "raise":
            raise AuditError(report)
        warnings.warn(describe(report, new), AuditWarning, stacklevel=2)


def describe(report, findings=None):
    """The summary line, then one line per finding (default: warnings and errors)."""
    lines = [report.summary()]
    for f in report.at_least("warning") if findings is None else findings:
        lines.append(f"[{f.code}] {f.severity} {f.subject}: {f.message} Fix: {f.fix}")
    return "\n".join(lines)


def _finding_codes(ignore):
    """`ignore` as a tuple of known finding codes; any iterable of str, read once.

    Raises:
        TypeError: for a single string, a mapping (whose values would be
            dropped: `{"MODE003": False}` would ignore MODE003), or anything
            but an iterable of str.
        ValueError: for an unknown code.
    """
    received = repr(ignore)
    if not isinstance(ignore, (str, bytes, collections.abc.Mapping)):
        try:
            ignore = tuple(ignore)  # a generator is read a single time
        except TypeError:
            pass
    if not isinstance(ignore, tuple) or not all(isinstance(c, str) for c in ignore):
        raise TypeError(
            "`ignore` must be a collection of finding codes, e.g. "
            f"ignore=['MODE003']. Received: ignore={received}"
        )
    unknown = [code for code in ignore if code not in CODES]
    if unknown:
        raise ValueError(
            f"Unknown finding codes in `ignore`: {unknown}. Available: {', '.join(CODES)}"
        )
    return ignore
