"""Each example, and `doctor`, run without its backend library: one message naming the extra.

The README's TensorFlow environment has no jax and its JAX environment no
TensorFlow. A `sitecustomize` module first on the subprocess's path makes
`import jax` (or `tensorflow`) fail as where it is not installed: the path
finder does not find it, so `importlib.util.find_spec` returns None too.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TENSORFLOW_EXAMPLES = (
    "accumulate_uneven.py",
    "custom_loop_tf.py",
    "hunt_nan.py",
    "mirrored_with_callbacks.py",
    "multi_worker.py",
    "subclassed_model.py",
)
JAX_EXAMPLES = ("custom_loop_jax.py", "jax_data_parallel.py", "jax_processes.py")
HIDE = textwrap.dedent(
    """
    import importlib.machinery

    _find_spec = importlib.machinery.PathFinder.find_spec


    def _hiding(name, path=None, target=None):
        if name.partition(".")[0] in {libraries!r}:
            return None
        return _find_spec(name, path, target)


    importlib.machinery.PathFinder.find_spec = _hiding
    """
)


def run_without(libraries, args, tmp_path):
    """Runs `python args...` where `libraries` (names) are not importable; returns the process."""
    (tmp_path / "sitecustomize.py").write_text(HIDE.format(libraries=tuple(libraries.split())))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=env,
        cwd=tmp_path, check=False,
    )


def test_the_hiding_makes_the_library_look_uninstalled(tmp_path):
    process = run_without(
        "jax", ["-c", "import importlib.util; print(importlib.util.find_spec('jax'))"], tmp_path
    )
    assert (process.returncode, process.stdout) == (0, "None\n")


@pytest.mark.parametrize("name", JAX_EXAMPLES)
def test_jax_example_without_jax_names_the_jax_extra(name, tmp_path):
    process = run_without("jax", [str(EXAMPLES / name)], tmp_path)
    assert process.returncode == 1
    assert process.stdout == ""
    assert process.stderr == (
        f"{name} needs jax, which is not installed in this environment "
        "(No module named 'jax').\n"
        "Install the [jax] extra from the repository's root:\n"
        '    pip install -c constraints.txt -e ".[jax]"\n'
        "The TensorFlow examples need no JAX.\n"
    )


@pytest.mark.parametrize("name", TENSORFLOW_EXAMPLES)
def test_tensorflow_example_without_tensorflow_names_the_tensorflow_extra(name, tmp_path):
    process = run_without("tensorflow", [str(EXAMPLES / name)], tmp_path)
    assert process.returncode == 1
    assert process.stdout == ""
    assert process.stderr == (
        f"{name} needs tensorflow, which is not installed in this environment "
        "(No module named 'tensorflow').\n"
        "Install the [tensorflow] extra from the repository's root:\n"
        '    pip install -c constraints.txt -e ".[tensorflow]"\n'
        "examples/jax_data_parallel.py, examples/custom_loop_jax.py and "
        "examples/jax_processes.py need no TensorFlow.\n"
    )


def test_doctor_without_tensorflow_names_the_extra_and_the_jax_doctor(tmp_path):
    process = run_without("tensorflow", ["-m", "keras_safe_dist", "doctor"], tmp_path)
    assert process.returncode == 2
    assert process.stderr == (
        "keras-safe-dist doctor: --backend tensorflow (the default) needs tensorflow, which is "
        "not installed. Install the [tensorflow] extra from the repository's root: "
        '`pip install -c constraints.txt -e ".[tensorflow]"`.\n'
        "On JAX, run `keras-safe-dist doctor --backend jax`.\n"
    )


def test_doctor_jax_without_jax_names_the_jax_extra(tmp_path):
    process = run_without("jax", ["-m", "keras_safe_dist", "doctor", "--backend", "jax"], tmp_path)
    assert process.returncode == 2
    assert process.stderr == (
        "keras-safe-dist doctor: --backend jax needs jax, which is not installed. "
        "Install the [jax] extra from the repository's root: "
        '`pip install -c constraints.txt -e ".[jax]"`.\n'
    )


def test_report_needs_neither_tensorflow_nor_jax(tmp_path):
    (tmp_path / "logs").mkdir()
    process = run_without("tensorflow jax", ["-m", "keras_safe_dist", "report", "logs"], tmp_path)
    # Its own answer for an empty folder, not a ModuleNotFoundError.
    assert process.returncode == 2
    assert process.stderr == (
        "keras-safe-dist report: nothing to report under logs: no audit_*.json, nan_onset.json "
        "or logged update statistics. Pass the log_dir given to the keras_safe_dist callbacks.\n"
    )
