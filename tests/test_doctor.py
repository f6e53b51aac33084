"""`keras-safe-dist doctor`: each probe's figures, the report, the command line."""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from keras_safe_dist import cli
from keras_safe_dist import doctor
from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Probe
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probe import measure
from keras_safe_dist.doctor.probe import one_line
from keras_safe_dist.doctor.probes import clipping
from keras_safe_dist.doctor.probes import empty_share
from keras_safe_dist.doctor.probes import identity_nan
from keras_safe_dist.doctor.probes import multi_worker
from keras_safe_dist.doctor.probes import nonfinite
from keras_safe_dist.doctor.probes import optimizer_accumulation
from keras_safe_dist.doctor.probes import sum_aggregation
from keras_safe_dist.doctor.probes import uneven_accumulation
from keras_safe_dist.doctor.probes import uneven_first_batch
from keras_safe_dist.doctor.probes import uneven_split

from conftest import mirrored_strategy

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = [
    "clip-before-allreduce",
    "optimizer-accumulation",
    "uneven-accumulation",
    "uneven-replica-split",
    "uneven-first-batch",
    "empty-share",
    "multi-worker-fit",
    "identity-nan",
    "sum-aggregation",
    "nonfinite-skip",
]


def run(probe):
    stock, safe = probe.PROBE.run(mirrored_strategy())
    return stock, safe


# Each probe on the tests' two replicas: stock shows its defect with the
# figure measured on keras 3.15.1 / tensorflow 2.21.0, the safe side passes.


def test_clipping_probe_stock_update_is_longer_than_clipped_safe_is_exact():
    stock, safe = run(clipping)
    assert stock.ok is False and 1.5 < stock.figure < 2.0  # 1.67 measured
    assert safe.ok is True and abs(safe.figure - 1.0) <= TOLERANCE


def test_optimizer_accumulation_probe_stock_crashes_safe_applies_two_updates():
    stock, safe = run(optimizer_accumulation)
    assert stock.ok is False
    assert stock.figure.startswith("RuntimeError: `merge_call` called while defining")
    assert safe == Side(True, 2)


def test_uneven_accumulation_probe_stock_weights_micro_batches_equally():
    stock, safe = run(uneven_accumulation)
    assert stock.ok is False and 0.1 < stock.figure < 0.25  # 0.175 measured
    assert safe.ok is True and safe.figure <= TOLERANCE


def test_uneven_split_probe_stock_overweights_the_emptier_replica():
    stock, safe = run(uneven_split)
    assert stock.ok is False and 0.01 < stock.figure < 0.05  # 0.0276 measured
    assert safe.ok is True and safe.figure <= TOLERANCE


def test_uneven_first_batch_probe_stock_crashes_building_the_model():
    stock, safe = run(uneven_first_batch)
    assert stock.ok is False
    assert stock.figure.startswith("InvalidArgumentError: Inputs to operation AddN")
    assert safe.ok is True and safe.figure <= TOLERANCE


def test_empty_share_probe_stock_breaks_batch_norm_statistics_of_the_empty_replica():
    stock, safe = run(empty_share)
    assert stock == Side(False, 1)
    assert safe == Side(True, 0)


def test_multi_worker_probe_stock_cannot_fit_safe_matches_one_device():
    stock, safe = run(multi_worker)
    assert stock.ok is False
    assert stock.figure.startswith("ValueError: Attempt to convert a value (PerReplica)")
    assert safe.ok is True and safe.figure <= TOLERANCE


def test_multi_worker_probe_is_skipped_with_a_reason_when_no_port_binds(monkeypatch):
    def refuse(count):
        raise OSError("Address family not supported")

    monkeypatch.setattr("keras_safe_dist.scale_out._cluster.free_ports", refuse)
    stock, safe = multi_worker.run()
    reason = "skipped: cannot bind a port on 127.0.0.1 (Address family not supported)"
    assert stock == Side(None, reason) and safe == Side(None, reason)
    result = doctor.Result(multi_worker.PROBE, stock, safe, 0.0)
    assert result.verdict == "skipped"
    assert doctor.exit_status([result]) == 0


def test_identity_probe_loss_is_exact_on_both_sides():
    stock, safe = run(identity_nan)
    assert stock == Side(True, 1.0)  # fixed since Keras 3.10
    assert safe == Side(True, 1.0)


def test_sum_aggregation_probe_stock_grows_exponentially_audit_reports_agg003():
    stock, safe = run(sum_aggregation)
    assert stock == Side(False, 30.0)  # 2, 6, 14, 30: not 2 per step
    # The cell says what was checked, in words, not only the code.
    assert safe == Side(
        True, "audit reports AGG003 (on-write variable with sum aggregation) for step_counter/count"
    )
    assert "passes when keras_safe_dist.audit(model) reports AGG003 (on-write variable" in (
        sum_aggregation.PROBE.checks
    )


def test_nonfinite_probe_stock_changes_every_state_variable_safe_none():
    stock, safe = run(nonfinite)
    # 4 weights, 8 Adam moments and the iteration counter; not the learning rate.
    assert stock == Side(False, 13)
    assert safe == Side(True, 0)


# Records, rendering and selection.


def test_probes_run_in_the_documented_order_with_unique_names():
    assert [probe.name for probe in doctor.PROBES] == NAMES
    assert [p.name for p in doctor.select(["nonfinite-skip", "clip-before-allreduce"])] == [
        "clip-before-allreduce", "nonfinite-skip",
    ]


def test_select_rejects_unknown_names_listing_the_available_ones():
    with pytest.raises(ValueError, match="Unknown probe name\\(s\\): nope. Available: clip-before"):
        doctor.select(["nope"])


def test_probe_name_must_be_a_slug():
    with pytest.raises(ValueError, match="Received: name='Not A Slug'"):
        Probe("Not A Slug", "checks", lambda strategy: None)


def test_measure_turns_an_exception_into_a_failed_side_in_one_line():
    def crash():
        raise RuntimeError(
            "Exception encountered when calling Cond.call().\n\n\x1b[1mThe real "
            "reason is here. More text follows.\x1b[0m\n\nArguments received"
        )

    assert measure(crash) == Side(False, "RuntimeError: The real reason is here.")
    assert one_line(ValueError("(PerReplica:{\n  0: big\n  1: dump\n}) to a Tensor.")) == (
        "ValueError: (PerReplica) to a Tensor."
    )


def test_an_error_naming_a_class_keeps_its_name_and_a_long_cell_ends_at_a_word():
    error = ValueError(
        "Attempt to convert a value (PerReplica:{\n  0: big\n}) with an unsupported type "
        "(<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor."
    )
    figure = one_line(error)
    assert figure == (
        "ValueError: Attempt to convert a value (PerReplica) with an unsupported type "
        "(PerReplica) to a Tensor."
    )
    long = "ValueError: " + "word " * 40
    cells = doctor.table(VERSIONS, 2, [doctor.Result(doctor.PROBES[0], Side(False, long), Side(True, 1.0), 1.0)])
    text = " ".join(line.split("|")[2].strip() for line in cells.splitlines() if line.startswith("| "))
    assert "word ..." in text and "wor ..." not in text and "wo..." not in text


def fake_results():
    probes = doctor.PROBES
    return [
        doctor.Result(probes[0], Side(False, 1.67), Side(True, 1.0), 1.0),
        doctor.Result(probes[1], Side(True, 2), Side(True, 2), 1.0),
        doctor.Result(probes[2], Side(False, 0.17), Side(False, "KeyError: 'x'"), 1.0),
    ]


VERSIONS = {"python": "3.11", "keras": "3.15.1", "tensorflow": "2.21.0", "keras_safe_dist": "0.1.0"}


def test_table_shows_versions_cells_verdicts_and_summary():
    text = doctor.table(VERSIONS, 2, fake_results())
    assert text.splitlines()[:2] == [
        "keras-safe-dist doctor: 2 replicas (logical CPU devices)",
        "Python 3.11, Keras 3.15.1, TensorFlow 2.21.0, keras_safe_dist 0.1.0",
    ]
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [cell.strip() for cell in rows[0].split("|")[1:-1]] == [
        "probe", "stock Keras", "SafeDistributedModel", "verdict",
    ]
    assert rows[1].split("|")[1:-1] == [
        " clip-before-allreduce  ", " defect: 1.67                    ",
        " ok: 1                      ", " fixed    ",
    ]
    assert rows[2].split("|")[4] == " stock ok "
    assert "FAIL: KeyError: 'x'" in text
    assert text.splitlines()[-1] == (
        "SafeDistributedModel passed 2 of 3 probes; stock Keras showed the defect in 1."
    )
    assert doctor.exit_status(fake_results()) == 1
    bare = doctor.table(VERSIONS, 2, fake_results(), with_header=False)
    assert bare.splitlines() == text.splitlines()[3:]


def all_probe_results():
    """Every probe with long figures: a crash on the stock side, a skip reason, a failure."""
    error = "InvalidArgumentError: Inputs to operation AddN of type AddN must have the same size and shape."
    skip = "skipped: cannot bind a port on 127.0.0.1 (Address family not supported)"
    sides = [
        (Side(False, error), Side(True, 4.9e-8)),
        (Side(None, skip), Side(None, skip)),
        (Side(False, 30.0), Side(False, "ValueError: " + "x" * 150)),
    ]
    return [
        doctor.Result(probe, *sides[number % len(sides)], 1.0)
        for number, probe in enumerate(doctor.PROBES)
    ]


def test_table_lines_fit_100_columns_and_list_each_probes_checks_below():
    versions = dict(VERSIONS, tensorflow="2.21.0-dev20250101", keras_safe_dist="0.1.0.dev12+g4e51c82")
    text = doctor.table(versions, 16, all_probe_results())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert max(len(line) for line in lines if line.startswith(("+", "|"))) == 100
    listed = lines[lines.index("What each probe checks, and the figures it measured:") + 1:-2]
    # all_probe_results()'s sides in turn: a crash and a number, two skips, a number and a crash.
    measured = ["; measured: SafeDistributedModel 4.9e-08", "", "; measured: stock 30"]
    for number, probe in enumerate(doctor.PROBES):
        expected = f"{probe.name}: {probe.checks}{measured[number % len(measured)]}"
        assert _listed(listed, probe.name) == expected
    # No probe's checks text is left in the table itself.
    rows = "\n".join(line for line in lines if line.startswith("| "))
    assert not any(probe.checks[:20] in rows for probe in doctor.PROBES)
    assert "x" * 80 not in text  # long figures wrap inside their cells


def _listed(listed, name):
    """The wrapped entry of probe `name` in the list below the table, as one line."""
    start = next(i for i, line in enumerate(listed) if line.startswith(f"  {name}: "))
    end = next((i for i in range(start + 1, len(listed)) if not listed[i].startswith("    ")), len(listed))
    return " ".join(line.strip() for line in listed[start:end])


def test_uneven_accumulation_line_says_what_its_figure_is_beside_the_figures():
    result = doctor.Result(uneven_accumulation.PROBE, Side(False, 0.35072216), Side(True, 6.2e-8), 1.0)
    lines = doctor.table(VERSIONS, 2, [result]).splitlines()
    line = _listed(lines[lines.index("What each probe checks, and the figures it measured:") + 1:], result.probe.name)
    assert line.endswith(
        "relative deviation of the update from one device's on the whole batch: ||update - one "
        "device's|| / ||one device's||, over all the weights (0 is correct); measured: stock "
        "0.3507, SafeDistributedModel 6.2e-08"
    )
    # The table's cells keep the bare figures.
    assert "| defect: 0.3507 " in "\n".join(lines)


def test_json_report_keeps_each_probes_checks_text():
    results = all_probe_results()
    data = doctor.to_json(VERSIONS, 2, results)
    assert [probe["checks"] for probe in data["probes"]] == [probe.checks for probe in doctor.PROBES]
    assert set(data["probes"][0]) == {"name", "checks", "stock", "safe", "verdict", "seconds"}


def test_json_report_replaces_non_finite_figures():
    result = doctor.Result(doctor.PROBES[7], Side(False, float("nan")), Side(True, 1.0), 0.5)
    data = doctor.to_json({"python": "3.11"}, 2, [result])
    assert data["probes"][0]["stock"] == {"ok": False, "figure": "NaN"}
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_strategy_needs_two_replicas_and_a_fresh_process():
    with pytest.raises(ValueError, match="Received: replicas=1"):
        doctor.make_strategy(1)
    # Listing devices initialises TensorFlow with conftest's two logical CPUs.
    assert len(tf.config.list_logical_devices("CPU")) == 2
    with pytest.raises(RuntimeError, match="needs 3 logical CPU devices, but TensorFlow was already initialised with 2"):
        doctor.make_strategy(3)


# The command line.


def test_unknown_probe_name_exits_2_listing_available_names(capsys):
    assert cli.main(["doctor", "--only", "clip-before-allreduce", "nope"]) == 2
    error = capsys.readouterr().err
    assert "Unknown probe name(s): nope." in error
    assert "Available: " + ", ".join(NAMES) in error


@pytest.mark.parametrize("value", ["1", "0", "-2", "two", "2.5"])
def test_bad_replicas_exit_2_with_the_rule(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["doctor", "--replicas", value])
    assert exit_info.value.code == 2
    assert f"expected an integer >= 2 (the defects need several replicas), received {value!r}" in (
        capsys.readouterr().err
    )


def test_doctor_json_run_passes_every_probe_for_safe_distributed_model():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.run(
        [sys.executable, "-m", "keras_safe_dist", "doctor", "--json"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    report = json.loads(process.stdout)
    assert set(report["versions"]) == {"python", "keras", "tensorflow", "keras_safe_dist"}
    assert report["replicas"] == 2
    assert [probe["name"] for probe in report["probes"]] == NAMES
    for probe in report["probes"]:
        assert set(probe) == {"name", "checks", "stock", "safe", "verdict", "seconds"}
        assert probe["checks"]
        for side in ("stock", "safe"):
            assert set(probe[side]) == {"ok", "figure"}
            assert isinstance(probe[side]["figure"], (int, float, str))
        assert probe["safe"]["ok"] is True, probe
    # Progress goes to stderr, one line before and after each probe.
    assert "[10/10] nonfinite-skip: fixed" in process.stderr
    defects = [p["name"] for p in report["probes"] if p["stock"]["ok"] is False]
    assert defects == [name for name in NAMES if name != "identity-nan"]


# TensorFlow's native log lines: absl's format ("I0000 00:00:...", tensorflow 2.18
# and 2.21) or TensorFlow's own, a date first ("2026-01-01 12:00:00.000000: I ...",
# tensorflow 2.20).
_NATIVE_LINE = re.compile(r"[IWEF]\d{4} |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] ")


def _native_lines(stderr):
    """TensorFlow's (and absl's) own log lines in `stderr`."""
    return [
        line
        for line in stderr.splitlines()
        if "absl::InitializeLog" in line or _NATIVE_LINE.match(line)
    ]


@functools.cache
def _tensorflow_start_up_lines():
    """The native lines a plain `import tensorflow` and one op print here (release-dependent)."""
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    process = subprocess.run(
        [sys.executable, "-c", "import tensorflow as tf; tf.constant(1.0) + 1.0"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    return _native_lines(process.stderr)


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_tensorflow_start_up_lines_appear_only_with_verbose(verbose):
    if verbose and not _tensorflow_start_up_lines():
        pytest.skip("this TensorFlow prints no start-up lines here: --verbose has none to show")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    argv = ["--verbose"] * verbose + ["doctor", "--only", "identity-nan"]
    process = subprocess.run(
        [sys.executable, "-m", "keras_safe_dist", *argv],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    lines = process.stderr.splitlines()
    if not verbose:
        assert lines[0] == "[1/1] identity-nan ..."
    assert bool(_native_lines(process.stderr)) is verbose, lines
