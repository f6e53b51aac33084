"""`keras-safe-dist doctor --backend jax`: the JAX probes' figures, the report, bad input.

The probes run in a process of their own (Keras's backend and JAX's device
count are fixed at start-up); this TensorFlow test process only starts it,
renders fake results and checks the command line.
"""

import importlib
import inspect
import json
import os
import pathlib
import subprocess
import sys

import pytest

from keras_safe_dist import cli
from keras_safe_dist import doctor
from keras_safe_dist.doctor import jax as doctor_jax
from keras_safe_dist.doctor.jax.probes import _tiny as jax_tiny
from keras_safe_dist.doctor.probe import TOLERANCE
from keras_safe_dist.doctor.probe import Side
from keras_safe_dist.doctor.probes import _tiny as tf_tiny
from keras_safe_dist.doctor.result import NotApplicable
from keras_safe_dist.doctor.result import choose
from keras_safe_dist.doctor.shared_probes import clipping
from keras_safe_dist.doctor.shared_probes import nonfinite
from keras_safe_dist.doctor.shared_probes import tiny as tiny_interface
from keras_safe_dist.doctor.shared_probes import uneven_accumulation

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX_NAMES = [
    "clip-before-allreduce",
    "uneven-accumulation",
    "uneven-batch",
    "empty-share",
    "nonfinite-skip",
]
NOT_APPLICABLE = [
    "optimizer-accumulation",
    "uneven-replica-split",
    "uneven-first-batch",
    "multi-worker-fit",
    "identity-nan",
    "sum-aggregation",
]
VERSIONS = {"python": "3.11", "keras": "3.15.1", "jax": "0.10.2", "keras_safe_dist": "0.1.0"}


@pytest.mark.skipif(not doctor_jax.installed(), reason="needs the [jax] extra")
def test_jax_doctor_json_stock_shows_each_defect_safe_matches_one_device():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.run(
        [sys.executable, "-m", "keras_safe_dist", "doctor", "--backend", "jax", "--json"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    report = json.loads(process.stdout)
    assert report["backend"] == "jax" and report["replicas"] == 2
    assert set(report["versions"]) == {"python", "keras", "jax", "keras_safe_dist"}
    assert [entry["name"] for entry in report["not_applicable"]] == NOT_APPLICABLE
    probes = {probe["name"]: probe for probe in report["probes"]}
    assert list(probes) == JAX_NAMES
    stock = {name: probe["stock"] for name, probe in probes.items()}
    safe = {name: probe["safe"] for name, probe in probes.items()}
    # Stock JAX clips the global gradient: no defect, both updates as on one device.
    assert stock["clip-before-allreduce"] == {"ok": True, "figure": pytest.approx(1.0, abs=TOLERANCE)}
    assert probes["clip-before-allreduce"]["verdict"] == "stock ok"
    # Micro-batches of 16, 16 and 2: stock weights them equally, its update 35% off
    # one device's (0.3507 measured).
    assert stock["uneven-accumulation"]["ok"] is False
    assert 0.3 < stock["uneven-accumulation"]["figure"] < 0.4
    # One batch of 5 on 2 devices: stock cannot shard it in any of the three.
    assert stock["uneven-batch"]["ok"] is False
    assert stock["uneven-batch"]["figure"].startswith(
        "evaluate, predict, fit crashed: IndivisibleError: Sharding NamedSharding implies"
    )
    assert stock["empty-share"]["ok"] is False
    assert stock["empty-share"]["figure"].startswith("IndivisibleError: ")
    # 4 weights, 8 Adam moments and the iteration counter; not the learning rate.
    assert stock["nonfinite-skip"] == {"ok": False, "figure": 13}
    for name in ("uneven-accumulation", "uneven-batch"):
        assert safe[name]["ok"] is True and 0 <= safe[name]["figure"] < 1e-5, safe[name]
    assert safe["empty-share"] == {"ok": True, "figure": 0}
    assert safe["nonfinite-skip"] == {"ok": True, "figure": 0}
    assert [probe["verdict"] for probe in probes.values()] == ["stock ok"] + ["fixed"] * 4
    # The versions, then the progress, on stderr: stdout holds only the JSON.
    assert "Python " in process.stderr and ", JAX 0.10" in process.stderr
    assert "[5/5] nonfinite-skip: fixed" in process.stderr


@pytest.mark.parametrize("shared", [clipping, nonfinite, uneven_accumulation], ids=lambda m: m.NAME)
def test_both_backends_run_the_shared_measurement_with_their_own_tiny(shared):
    module = shared.__name__.rpartition(".")[2]
    for package, tiny in (("keras_safe_dist.doctor.probes", tf_tiny), ("keras_safe_dist.doctor.jax.probes", jax_tiny)):
        probe = importlib.import_module(f"{package}.{module}").PROBE
        assert probe.name == shared.NAME
        assert probe.run.func is shared.run and probe.run.args == (tiny,)
        # The same figure on both backends, said in the same words.
        assert getattr(shared, "FIGURE", getattr(shared, "CHECKS", None)) in probe.checks


def _parameters(function, place):
    """`(name, kind, default)` of each parameter, the place's name (a backend's own word) as "place"."""
    return [
        ("place" if name == place else name, parameter.kind, parameter.default)
        for name, parameter in inspect.signature(function).parameters.items()
    ]


def test_each_backends_tiny_has_the_shared_interface():
    # The shared probes call these by position and keyword: same order, names and defaults.
    for name in ("devices", "one_device", "mlp", "update"):
        expected = _parameters(getattr(tiny_interface.Tiny, name), "place")[1:]  # less self
        for tiny, place in ((tf_tiny, "strategy"), (jax_tiny, "distribution")):
            assert _parameters(getattr(tiny, name), place) == expected, (tiny.__name__, name)
    assert jax_tiny.one_device() is None and jax_tiny.devices(None) == 1


def test_backend_torch_exits_2_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["doctor", "--backend", "torch"])
    assert exit_info.value.code == 2
    assert "argument --backend: invalid choice: 'torch' (choose from tensorflow, jax)" in (
        capsys.readouterr().err.replace("'tensorflow'", "tensorflow").replace("'jax'", "jax")
    )


def test_backend_jax_without_jax_exits_2_saying_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(doctor_jax, "installed", lambda: False)
    assert cli.main(["doctor", "--backend", "jax"]) == 2
    assert capsys.readouterr().err == (
        "keras-safe-dist doctor: --backend jax needs jax, which is not installed. "
        "Install the [jax] extra from the repository's root: "
        '`pip install -c constraints.txt -e ".[jax]"`.\n'
    )


def test_child_environment_sets_the_backend_and_replaces_the_device_count():
    env = doctor_jax.child_environment(
        3, {"XLA_FLAGS": "--xla_cpu_fast_math --xla_force_host_platform_device_count=8"}
    )
    assert env["KERAS_BACKEND"] == "jax" and env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_cpu_fast_math --xla_force_host_platform_device_count=3"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_only_a_probe_without_jax_meaning_says_why():
    probes = [doctor.PROBES[0]]  # any list of probes: only the names matter here
    with pytest.raises(ValueError) as error:
        choose(probes, ["identity-nan"], [NotApplicable("identity-nan", "no per-replica copies")])
    assert str(error.value) == (
        "Unknown probe name(s): identity-nan. Available: clip-before-allreduce. Pass names "
        "from that list to --only. identity-nan is not applicable here: no per-replica copies"
    )


def test_jax_report_names_jax_and_lists_the_probes_that_do_not_apply():
    result = doctor.Result(doctor.PROBES[0], Side(True, 1.0), Side(True, 1.0), 1.0)
    skipped = [NotApplicable("multi-worker-fit", "MultiWorkerMirroredStrategy is TensorFlow's")]
    text = doctor.table(VERSIONS, 2, [result], backend="jax", not_applicable=skipped)
    lines = text.splitlines()
    assert lines[:2] == [
        "keras-safe-dist doctor: 2 devices (JAX CPU devices, keras.distribution.DataParallel)",
        "Python 3.11, Keras 3.15.1, JAX 0.10.2, keras_safe_dist 0.1.0",
    ]
    at = lines.index("Not applicable on JAX:")
    assert lines[at + 1] == "  multi-worker-fit: MultiWorkerMirroredStrategy is TensorFlow's"
    assert lines[-1] == "SafeDistributedModel passed 1 of 1 probes; stock Keras showed the defect in 0."
    data = doctor.to_json(VERSIONS, 2, [result], backend="jax", not_applicable=skipped)
    assert data["backend"] == "jax"
    assert data["not_applicable"] == [
        {"name": "multi-worker-fit", "reason": "MultiWorkerMirroredStrategy is TensorFlow's"}
    ]
    assert "not_applicable" not in doctor.to_json(VERSIONS, 2, [result], backend="jax")
