"""The conformance runner's passes: which backend runs which Keras test files, with which -k."""

import argparse
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "conformance_run_passes", Path(__file__).resolve().parents[1] / "conformance" / "run.py"
)
run = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run)


def passes(ci=False, backend=None, files=None, keyword=None):
    return run._passes(argparse.Namespace(ci=ci, backend=backend, files=files, keyword=keyword))


def test_ci_runs_tensorflows_subset_then_jaxs_model_trainer_and_saving_files():
    (tf_backend, tf_files, tf_keyword), (jax_backend, jax_files, jax_keyword) = passes(ci=True)
    assert (tf_backend, tf_keyword) == ("tensorflow", None)
    assert "trainers/trainer_test.py" not in tf_files and len(tf_files) == 11
    assert jax_backend == "jax"
    assert jax_files == [
        "models/model_test.py", "models/functional_test.py", "models/sequential_test.py",
        "trainers/trainer_test.py", "saving/saving_lib_test.py",
    ]
    assert jax_keyword == "not test_weights_sharding_efficientnet and not test_quantize"


def test_ci_with_a_backend_runs_that_pass_and_combines_the_users_keyword():
    assert passes(ci=True, backend="jax", keyword="compute_loss") == [(
        "jax", list(run.JAX_CI_FILES),
        "(compute_loss) and (not test_weights_sharding_efficientnet and not test_quantize)",
    )]
    assert [backend for backend, _, _ in passes(ci=True, backend="tensorflow")] == ["tensorflow"]


def test_jax_has_no_tensorflow_files_and_says_which_it_has():
    assert passes(backend="jax", files=["model_test"]) == [
        ("jax", ["models/model_test.py"], None)
    ]
    assert len(passes(backend="jax")[0][1]) == 10
    with pytest.raises(run.SetupError, match=r"Unknown --files \['distribute_test'\] on jax"):
        passes(backend="jax", files=["distribute_test"])


def test_jax_pass_without_jax_is_a_setup_error_naming_the_extra(monkeypatch):
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(run.SetupError, match=r"pip install -c constraints.txt -e \"\.\[jax\]\""):
        run._check_backend("jax")
    run._check_backend("tensorflow")
