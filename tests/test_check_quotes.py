"""docs/check_quotes.py: the outputs quoted in the README and the docs match real runs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "check_quotes.py"

_spec = importlib.util.spec_from_file_location("check_quotes", SCRIPT)
check_quotes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_quotes)


def test_the_hunt_nan_paragraph_quoted_in_the_docs_is_what_the_example_prints():
    # The quickstart check (about 45 s more) runs with `python3 docs/check_quotes.py`.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "hunt_nan"], capture_output=True, text=True, timeout=600
    )
    assert (result.returncode, result.stdout) == (0, "hunt_nan: matches\n"), result.stderr


def _quoted_paragraph():
    quoted = next(b for b in check_quotes.text_blocks(check_quotes.NAN_DOC) if b.startswith("NaN onset"))
    return check_quotes.joined(quoted)


@pytest.mark.parametrize("drift", [("0.6874, 0.664", "0.6874, 0.665"), ("0.664, 0.6523", "0.664, 0.6524")])
def test_a_drifted_quote_is_reported_with_a_diff(drift, monkeypatch):
    printed = _quoted_paragraph().replace(*drift)
    assert printed != _quoted_paragraph()
    monkeypatch.setattr(check_quotes, "run", lambda argv, cwd: printed + "\n\nepoch: 0\n")
    (problem,) = check_quotes.check_hunt_nan()
    assert problem.startswith("docs/nan_detector.md drifted:\n--- quoted\n+++ printed")
    assert "+" + printed in problem.splitlines()


def test_the_onset_batchs_logged_loss_may_read_nan(monkeypatch):
    # Whether the NaN reaches the logged mean depends on the CPU (docs/nan_detector.md).
    printed = _quoted_paragraph().replace("0.664, 0.6523.", "0.664, nan.")
    assert printed != _quoted_paragraph()
    monkeypatch.setattr(check_quotes, "run", lambda argv, cwd: printed + "\n\nepoch: 0\n")
    assert check_quotes.check_hunt_nan() == []
    # Only there: a nan in an earlier step's place is drift.
    earlier = _quoted_paragraph().replace("0.6874, 0.664", "0.6874, nan")
    monkeypatch.setattr(check_quotes, "run", lambda argv, cwd: earlier + "\n\nepoch: 0\n")
    assert len(check_quotes.check_hunt_nan()) == 1
