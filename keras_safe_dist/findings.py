"""Findings: what the audits and detectors report, with stable codes.

Every check in keras_safe_dist reports a `Finding`: a stable code (like a
linter's), a severity, the subject it is about (a variable path, a layer, an
object), what is wrong and the fix in one sentence. An `AuditReport` groups
the findings of one audit and renders them as a markdown table, as JSON-ready
data and as a one-line summary.
"""

import dataclasses

__all__ = [
    "CODES",
    "SEVERITIES",
    "AuditReport",
    "Code",
    "Finding",
    "markdown_cell",
    "markdown_row",
]

SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True)
class Code:
    """A registered finding code: its family, severity and one-line title.

    The registered codes are the values of `CODES`; `Finding.of` takes the
    severity from there.

    Args:
        family: the group of checks, e.g. `"aggregation"` or `"scope"`.
        severity: `"error"`, `"warning"` or `"info"`.
        title: what the code means, in one line.

    Example:

    ```python
    from keras_safe_dist.findings import CODES

    code = CODES["AGG003"]
    print(code.severity, code.title)  # error on-write variable with sum aggregation
    ```
    """

    family: str
    severity: str
    title: str


CODES = {
    # Aggregation: how a variable's updates are combined across replicas.
    "AGG001": Code(
        "aggregation", "error", "trainable variable with an aggregation other than none"
    ),
    "AGG002": Code(
        "aggregation", "error", "optimizer slot with an aggregation other than none"
    ),
    "AGG003": Code("aggregation", "error", "on-write variable with sum aggregation"),
    "AGG004": Code(
        "aggregation", "warning", "metric accumulator that is not replica-local"
    ),
    "AGG005": Code(
        "aggregation", "error", "variable of a distributed model that is not distributed"
    ),
    "AGG006": Code("aggregation", "warning", "integer variable with mean aggregation"),
    # Scope: which strategy a variable was created under.
    "SCOPE001": Code("scope", "error", "model built outside the training strategy"),
    "SCOPE002": Code(
        "scope", "error", "optimizer built outside the training strategy"
    ),
    "SCOPE003": Code("scope", "error", "metric built outside the training strategy"),
    "SCOPE004": Code(
        "scope", "error", "loss-scale state built outside the training strategy"
    ),
    "SCOPE005": Code(
        "scope", "error", "variable created during fit outside the training strategy"
    ),
    "SCOPE006": Code(
        "scope", "error", "compile or fit called inside another strategy's scope"
    ),
    # Training mode: layers that behave differently in training.
    "MODE001": Code(
        "training mode", "error", "layer did not run in training mode"
    ),
    "MODE002": Code(
        "training mode", "error", "non-trainable state differs across replicas"
    ),
    "MODE003": Code(
        "training mode", "warning", "frozen BatchNormalization in a model being trained"
    ),
    "MODE004": Code(
        "training mode", "info", "BatchNormalization statistics differ across replicas"
    ),
    # Stock model: what keras.Model's own update gets wrong on several replicas.
    "DIST001": Code(
        "stock model", "error", "optimizer clips each replica's gradient before the all-reduce"
    ),
    "DIST002": Code(
        "stock model", "error", "optimizer accumulates gradients under a multi-replica strategy"
    ),
    "DIST003": Code(
        "stock model", "warning",
        "loss divides by each replica's own weight or mask total",
    ),
    "DIST004": Code(
        "stock model", "info", "loss mis-weights a batch that splits unevenly"
    ),
    "DIST005": Code(
        "stock model", "error", "stock fit under MultiWorkerMirroredStrategy"
    ),
    # Custom training loops: a stateless train step, audited by audit_train_step().
    "LOOP001": Code(
        "custom loop", "error", "train step calls the model in inference mode"
    ),
    "LOOP002": Code(
        "custom loop", "error",
        "train step does not thread the updated non-trainable state",
    ),
    "LOOP003": Code(
        "custom loop", "error",
        "train step does not advance the optimizer state or the weights",
    ),
    "LOOP004": Code(
        "custom loop", "warning",
        "train state or batch not laid out as the distribution says",
    ),
    "LOOP005": Code(
        "custom loop", "error", "train step does not thread the metric state"
    ),
    # Backend: checks that have no meaning on the backend Keras runs on.
    "JAX001": Code(
        "backend", "info", "tf.distribute check that does not apply on the JAX backend"
    ),
    "JAX002": Code(
        "backend", "warning",
        "variables created before the keras.distribution distribution was set",
    ),
    # Non-finite values.
    "NAN001": Code("non-finite", "error", "non-finite value during training"),
    "NAN002": Code("non-finite", "error", "too many consecutive skipped updates"),
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem found by an audit.

    Args:
        code: a stable code from `CODES`, e.g. `"AGG003"`.
        severity: `"error"`, `"warning"` or `"info"`.
        subject: what the finding is about: a variable path, a layer or
            object name.
        message: what is wrong, with the values that show it.
        fix: what to do, in one sentence.

    Raises:
        ValueError: when `code` or `subject` is not a non-empty string, or
            `severity` is not one of `SEVERITIES`.

    Example:

    ```python
    finding = keras_safe_dist.Finding(
        code="AGG003",
        severity="error",
        subject="dense/step_counter",
        message="on-write variable with sum aggregation.",
        fix="Create it with aggregation='mean' or 'only_first_replica'.",
    )
    print(finding.to_dict()["code"])  # AGG003
    ```
    """

    code: str
    severity: str
    subject: str
    message: str
    fix: str

    def __post_init__(self):
        if not isinstance(self.code, str) or not self.code:
            raise ValueError(
                f"`code` must be a non-empty string. Received: code={self.code!r}"
            )
        if self.severity not in SEVERITIES:
            raise ValueError(
                f"`severity` must be one of {SEVERITIES}. "
                f"Received: severity={self.severity!r}"
            )
        if not isinstance(self.subject, str) or not self.subject:
            raise ValueError(
                "`subject` must be a non-empty string. "
                f"Received: subject={self.subject!r}"
            )

    @classmethod
    def of(cls, code, subject, message, fix):
        """A finding with the severity registered for `code` in `CODES`.

        Args:
            code: a code registered in `CODES`, e.g. `"AGG003"`.
            subject: what the finding is about.
            message: what is wrong.
            fix: what to do, in one sentence.

        Returns:
            A `Finding` whose severity is `CODES[code].severity`.

        Raises:
            ValueError: when `code` is not in `CODES` (the message lists the
                available codes), or `subject` is not a non-empty string.

        Example:

        ```python
        finding = Finding.of("MODE003", "model/bn", "frozen.", "Unfreeze it.")
        print(finding.severity)  # warning
        ```
        """
        if code not in CODES:
            raise ValueError(
                f"Unknown finding code {code!r}. Available: {', '.join(CODES)}"
            )
        return cls(code, CODES[code].severity, subject, message, fix)

    def to_dict(self):
        """The finding as JSON-ready data.

        Returns:
            A dict with the keys `code`, `severity`, `subject`, `message` and
            `fix`; `Finding(**data)` makes the finding again.
        """
        return dataclasses.asdict(self)


class AuditReport:
    """The findings of one audit.

    Iterating over a report yields its findings, and `len(report)` is their
    number. The codes in `ignore` are dropped and kept in `.ignored`.

    Args:
        name: the audit's name, e.g. `"aggregation"`.
        findings: the `Finding`s, in the order they were found.
        ignore: codes to drop.

    Example:

    ```python
    report = keras_safe_dist.audit(model)  # an AuditReport
    print(report.summary())  # pre-flight audit: 1 error, 0 warnings, 0 info (AGG003)
    for finding in report.at_least("warning"):
        print(finding.code, finding.subject, finding.fix)
    ```
    """

    def __init__(self, name, findings=(), ignore=()):
        self.name = name
        self.ignored = tuple(ignore)
        self.findings = tuple(f for f in findings if f.code not in self.ignored)

    def __len__(self):
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def __repr__(self):
        return f"<AuditReport {self.summary()}>"

    def codes(self):
        """The codes found, each once, in order of first appearance.

        Returns:
            A tuple of str.
        """
        return tuple(dict.fromkeys(f.code for f in self.findings))

    def counts(self):
        """The number of findings per severity, every severity present.

        Returns:
            A dict `{severity: count}` over `SEVERITIES`, in that order.
        """
        counts = dict.fromkeys(SEVERITIES, 0)
        for finding in self.findings:
            counts[finding.severity] += 1
        return counts

    def at_least(self, severity):
        """The findings of `severity` or worse.

        Args:
            severity: `"error"`, `"warning"` or `"info"`.

        Returns:
            A tuple of `Finding`s, in the report's order.

        Raises:
            ValueError: when `severity` is not one of `SEVERITIES`.
        """
        if severity not in SEVERITIES:
            raise ValueError(
                f"`severity` must be one of {SEVERITIES}. "
                f"Received: severity={severity!r}"
            )
        worst = SEVERITIES.index(severity)
        return tuple(
            f for f in self.findings if SEVERITIES.index(f.severity) <= worst
        )

    def summary(self):
        """One line: the audit, the counts per severity and the codes.

        Returns:
            A str such as `"scope audit: 1 error, 0 warnings, 0 info (SCOPE002)"`.
        """
        counts = self.counts()
        parts = ", ".join(
            f"{count} {severity}{'' if count == 1 or severity == 'info' else 's'}"
            for severity, count in counts.items()
        )
        codes = f" ({', '.join(self.codes())})" if self.findings else ""
        return f"{self.name} audit: {parts}{codes}"

    def to_markdown(self):
        """A markdown table of the findings, or a line saying there are none.

        Returns:
            A str: the summary in bold, then a table with one row per finding
            (code, severity, subject, message, fix).
        """
        if not self.findings:
            return f"**{self.name} audit**: no findings."
        rows = [
            f"**{self.summary()}**",
            "",
            "| code | severity | subject | message | fix |",
            "| --- | --- | --- | --- | --- |",
        ]
        for f in self.findings:
            cells = (f.code, f.severity, f.subject, f.message, f.fix)
            rows.append(markdown_row(cells))
        return "\n".join(rows)

    def to_dict(self):
        """JSON-ready: name, summary, counts, ignored codes and findings.

        Returns:
            A dict with the keys `name`, `summary`, `counts`, `ignored` and
            `findings` (each a `Finding.to_dict()`).
        """
        return {
            "name": self.name,
            "summary": self.summary(),
            "counts": self.counts(),
            "ignored": list(self.ignored),
            "findings": [f.to_dict() for f in self.findings],
        }

    @classmethod
    def from_dict(cls, data):
        """The inverse of `to_dict`.

        Args:
            data: a dict as `to_dict` returns it; `ignored` is optional.

        Returns:
            An `AuditReport`.

        Raises:
            ValueError: when `data` is not a dict with a `name` and a list of
                `findings` (the message names what is missing), or a finding
                has an invalid field (see `Finding`).
            TypeError: when a finding is not a dict of the `Finding` fields.
        """
        fields = ", ".join(f.name for f in dataclasses.fields(Finding))
        shape = (
            "a dict with `name` (the audit's name) and `findings` (a list of "
            f"dicts with the keys {fields}), as to_dict() returns"
        )
        if not isinstance(data, dict):
            raise ValueError(
                f"AuditReport.from_dict() needs {shape}. "
                f"Received: {type(data).__name__}"
            )
        missing = [key for key in ("name", "findings") if key not in data]
        if missing or not isinstance(data["findings"], list):
            problem = (
                f"missing: {', '.join(missing)}" if missing
                else f"`findings` is a {type(data['findings']).__name__}"
            )
            raise ValueError(
                f"AuditReport.from_dict() needs {shape}; {problem}. "
                f"Received keys: {sorted(data)}"
            )
        for finding in data["findings"]:
            if not isinstance(finding, dict):
                raise TypeError(
                    f"Each of `findings` must be a dict with the keys {fields}. "
                    f"Received: {finding!r}"
                )
        findings = [Finding(**f) for f in data["findings"]]
        report = cls(data["name"], findings)
        report.ignored = tuple(data.get("ignored", ()))
        return report


def markdown_row(cells):
    """One markdown table row of `cells`, each escaped with `markdown_cell`.

    Args:
        cells: the row's values.

    Returns:
        A str such as `"| a | b |"`.
    """
    return "| " + " | ".join(markdown_cell(cell) for cell in cells) + " |"


def markdown_cell(text):
    """`text` as one cell of a markdown table row.

    `|` is escaped as `\\|` and each line break becomes a space, so a cell
    cannot split into several cells or start a new row. Every table
    keras_safe_dist prints or writes escapes its cells with this.

    Args:
        text: the cell's value; converted with `str()`.

    Returns:
        A str without line breaks or unescaped `|`.

    Example:

    ```python
    markdown_cell("a | b\\nc")  # 'a \\\\| b c'
    ```
    """
    text = str(text).replace("\r\n", "\n").replace("\r", "\n")
    return text.replace("|", "\\|").replace("\n", " ")
