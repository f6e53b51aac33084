import json

import pytest

from keras_safe_dist.findings import CODES
from keras_safe_dist.findings import SEVERITIES
from keras_safe_dist.findings import AuditReport
from keras_safe_dist.findings import Finding
from keras_safe_dist.findings import markdown_cell
from keras_safe_dist.findings import markdown_row


def finding(code="AGG003", subject="model/counter/count"):
    return Finding.of(code, subject, "it | breaks\nhere", "fix it")


def test_finding_takes_the_registered_severity():
    assert finding("AGG003").severity == "error"
    assert finding("AGG004").severity == "warning"
    assert finding("MODE004").severity == "info"


def test_every_code_has_a_family_a_known_severity_and_a_title():
    for code, registered in CODES.items():
        assert registered.severity in SEVERITIES, code
        assert registered.family and registered.title, code


def test_unknown_code_lists_the_available_ones():
    with pytest.raises(ValueError, match="Unknown finding code 'AGG999'. Available: AGG001, AGG002"):
        Finding.of("AGG999", "x", "m", "f")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"severity": "fatal"}, r"`severity` must be one of \('error', 'warning', 'info'\). Received: severity='fatal'"),
        ({"code": ""}, "`code` must be a non-empty string. Received: code=''"),
        ({"subject": ""}, "`subject` must be a non-empty string. Received: subject=''"),
    ],
)
def test_finding_rejects_bad_fields(kwargs, match):
    fields = {"code": "X1", "severity": "error", "subject": "s", "message": "m", "fix": "f", **kwargs}
    with pytest.raises(ValueError, match=match):
        Finding(**fields)


def test_report_counts_summary_and_ignored_codes():
    report = AuditReport(
        "aggregation",
        [finding("AGG003", "a"), finding("AGG004", "b"), finding("AGG003", "c"), finding("MODE004", "d")],
        ignore=("AGG004",),
    )
    assert len(report) == 3
    assert report.counts() == {"error": 2, "warning": 0, "info": 1}
    assert report.codes() == ("AGG003", "MODE004")
    assert report.summary() == "aggregation audit: 2 errors, 0 warnings, 1 info (AGG003, MODE004)"
    assert [f.subject for f in report.at_least("warning")] == ["a", "c"]
    assert [f.subject for f in report.at_least("info")] == ["a", "c", "d"]
    with pytest.raises(ValueError, match="Received: severity='bad'"):
        report.at_least("bad")


def test_markdown_is_a_table_with_escaped_cells():
    lines = AuditReport("scope", [finding()]).to_markdown().splitlines()
    assert lines[0] == "**scope audit: 1 error, 0 warnings, 0 info (AGG003)**"
    assert lines[2] == "| code | severity | subject | message | fix |"
    assert lines[4] == "| AGG003 | error | model/counter/count | it \\| breaks here | fix it |"
    assert AuditReport("scope").to_markdown() == "**scope audit**: no findings."


def test_dict_is_json_ready_and_round_trips():
    report = AuditReport("scope", [finding(), finding("MODE003", "bn")], ignore=("AGG001",))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["counts"] == {"error": 1, "warning": 1, "info": 0}
    assert data["ignored"] == ["AGG001"]
    assert data["findings"][1] == {
        "code": "MODE003", "severity": "warning", "subject": "bn",
        "message": "it | breaks\nhere", "fix": "fix it",
    }
    again = AuditReport.from_dict(data)
    assert again.findings == report.findings
    assert again.summary() == report.summary()
    assert again.ignored == ("AGG001",)


@pytest.mark.parametrize("data, problem", [
    ({}, "missing: name, findings. Received keys: []"),
    ({"name": "scope"}, "missing: findings. Received keys: ['name']"),
    ({"name": "scope", "findings": "none"}, "`findings` is a str. Received keys: ['findings', 'name']"),
    ([1, 2], "Received: list"),
])
def test_from_dict_of_the_wrong_shape_names_what_is_missing(data, problem):
    with pytest.raises(ValueError) as error:
        AuditReport.from_dict(data)
    message = str(error.value)
    assert message.startswith(
        "AuditReport.from_dict() needs a dict with `name` (the audit's name) and `findings` "
        "(a list of dicts with the keys code, severity, subject, message, fix), as to_dict() returns"
    )
    assert message.endswith(problem)


def test_every_table_escapes_its_cells_alike():
    assert markdown_cell("a | b\nc\r\nd") == "a \\| b c d"
    assert markdown_row(["x|y", 1]) == "| x\\|y | 1 |"
