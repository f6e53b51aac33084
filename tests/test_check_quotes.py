"""docs/check_quotes.py: the outputs quoted in the README and the docs match real runs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

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


def test_a_drifted_quote_is_reported_with_a_diff(monkeypatch):
    quoted = next(b for b in check_quotes.text_blocks(check_quotes.NAN_DOC) if b.startswith("NaN onset"))
    printed = check_quotes.joined(quoted).replace("0.664, 0.6523", "0.664, nan")
    monkeypatch.setattr(check_quotes, "run", lambda argv, cwd: printed + "\n\nepoch: 0\n")
    (problem,) = check_quotes.check_hunt_nan()
    assert problem.startswith("docs/nan_detector.md drifted:\n--- quoted\n+++ printed")
    assert "+" + printed in problem.splitlines()
