"""Judge `SafeDistributedModel` as a drop-in with Keras's own tests.

Downloads the sdist of the installed Keras, runs twelve of its test files
twice against the installed Keras, stock and with every `keras.Model` swapped
for `SafeDistributedModel`, and lists each test that passes stock but not
swapped. `--backend jax` runs them on Keras's JAX backend (`KERAS_BACKEND=jax`);
`--ci` runs a subset on each backend. See docs/conformance.md.

Usage: python3 conformance/run.py [--ci] [--backend {tensorflow,jax}] [--files NAME ...]
       [-k EXPR] [--keep]
"""

import argparse
import ast
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# Test id -> why `SafeDistributedModel` is meant to fail it. Ids are pytest node
# ids as the report prints them: "models/model_test.py::ModelTest::test_x".
EXPECTED_DIFFERENCES: dict[str, str] = {}

TEST_FILES = (
    "models/model_test.py",
    "models/functional_test.py",
    "models/sequential_test.py",
    "saving/saving_lib_test.py",
    "saving/saving_api_test.py",
    "backend/tensorflow/distribute_test.py",
    "backend/tensorflow/saved_model_test.py",
    "trainers/trainer_test.py",
    "callbacks/model_checkpoint_test.py",
    "callbacks/backup_and_restore_test.py",
    "callbacks/early_stopping_test.py",
    "callbacks/tensorboard_test.py",
)
# `--ci` runs all but trainer_test.py, which alone takes 60% of the time (docs/conformance.md).
CI_FILES = tuple(name for name in TEST_FILES if name != "trainers/trainer_test.py")
# On JAX: every file but TensorFlow's own; `--ci` runs the model, trainer and saving ones.
JAX_FILES = tuple(name for name in TEST_FILES if not name.startswith("backend/tensorflow/"))
JAX_CI_FILES = (
    "models/model_test.py",
    "models/functional_test.py",
    "models/sequential_test.py",
    "trainers/trainer_test.py",
    "saving/saving_lib_test.py",
)
# The JAX CI pass leaves out what tests neither the model class nor its step and takes a
# quarter of the time: saving lib's EfficientNet weight sharding and model quantization.
JAX_CI_KEYWORD = "not test_weights_sharding_efficientnet and not test_quantize"
BACKENDS = ("tensorflow", "jax")

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "conformance" / ".cache"

_MODEL_MODULES = {"keras", "keras.models", "keras.src.models", "keras.src.models.model"}
_MODEL_PATHS = {f"{module}.Model" for module in _MODEL_MODULES} | {"models.Model"}
_CLASS_CHECKS = {"isinstance", "issubclass", "assertIsInstance", "assertNotIsInstance"}
_IMPORT = "from keras_safe_dist import SafeDistributedModel; "

# Keras's repository conftest.py is not in the sdist; this is what it does on the TF and
# JAX backends (JAX_DEFAULT_DTYPE_BITS=32 is set in the child's environment).
_CONFTEST = '''"""Written by keras_safe_dist's conformance/run.py."""
import pytest
from keras.src.backend import backend


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: trainable backends only")
    config.addinivalue_line("markers", "multi_device: several devices only")


def _devices():
    # Keras's conftest counts devices for jax and torch only: on TF there is one.
    if backend() != "jax":
        return 1
    import jax

    return jax.device_count()


def pytest_collection_modifyitems(config, items):
    single = _devices() < 2
    for item in items:
        if "multi_device" in item.keywords and single:
            item.add_marker(pytest.mark.skip(reason="Requires multiple devices"))
'''
# trainer_test.py imports jax at the top but uses it in a few tests only. Without jax,
# both copies get Keras's own lazy module instead: those tests fail in both, the rest run.
_JAX_IMPORT = ("\nimport jax\n", "\nfrom keras.src.utils.module_utils import jax\n")


class SetupError(Exception):
    """The runner could not prepare or run the tests (exit status 2)."""


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def swap_model_references(source):
    """Rewrites references to `keras.Model` in test source to `SafeDistributedModel`.

    Matches `keras.Model`, `keras.models.Model`, `keras.src.models.Model`,
    `keras.src.models.model.Model`, `models.Model` and a bare `Model` imported
    from those modules. The class argument of `isinstance`, `issubclass` and
    `assert[Not]IsInstance` stays stock. Line numbers are kept, so tracebacks
    match the stock copy's.

    Args:
        source: Python source of a test module.

    Returns:
        The rewritten source; `source` itself when nothing matched.
    """
    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in _MODEL_MODULES
        for alias in node.names
        if alias.name == "Model"
    }
    kept = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            callee = _dotted(node.func) or ""
            if callee.rpartition(".")[2] in _CLASS_CHECKS:
                kept.update(id(inner) for inner in ast.walk(node.args[1]))
    targets = [
        node
        for node in ast.walk(tree)
        if id(node) not in kept
        and (_dotted(node) in _MODEL_PATHS if isinstance(node, ast.Attribute) else
             isinstance(node, ast.Name) and node.id in imported and isinstance(node.ctx, ast.Load))
    ]
    if not targets:
        return source
    # ast offsets count UTF-8 bytes within a line.
    lines = [line.encode() for line in source.splitlines(keepends=True)]
    for node in sorted(targets, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        first, last = node.lineno - 1, node.end_lineno - 1
        head, tail = lines[first][: node.col_offset], lines[last][node.end_col_offset :]
        lines[first : last + 1] = [head + b"SafeDistributedModel" + tail] + [b"\n"] * (last - first)
    first_import = next(
        node for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__"
    )
    lines[first_import.lineno - 1] = _IMPORT.encode() + lines[first_import.lineno - 1]
    return b"".join(lines).decode()


def fetch_sdist(version):
    """Returns the cached Keras sdist of `version`, downloading it with pip first if needed."""
    path = CACHE / f"keras-{version}.tar.gz"
    if not path.exists():
        print(f"Downloading the keras {version} sdist into {CACHE} ...", flush=True)
        command = [sys.executable, "-m", "pip", "download", f"keras=={version}",
                   "--no-binary", ":all:", "--no-deps", "--disable-pip-version-check", "-d", str(CACHE)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not path.exists():
            raise SetupError(f"`{' '.join(command)}` failed (exit {done.returncode}); expected "
                             f"{path}. pip said:\n{done.stderr.strip()[-2000:]}")
    return path


def prepare(sdist, files, dest, swap):
    """Writes the sdist's pytest settings, the conftest and `files` (swapped if asked) into `dest`."""
    dest.mkdir(parents=True)
    (dest / "conftest.py").write_text(_CONFTEST)
    with tarfile.open(sdist) as archive:
        root = archive.getnames()[0].split("/")[0]
        members = {"pyproject.toml": "pyproject.toml"} | {f"keras/src/{name}": name for name in files}
        for member, target in members.items():
            try:
                text = archive.extractfile(f"{root}/{member}").read().decode()
            except KeyError as error:
                raise SetupError(f"{sdist} has no {member}") from error
            if target.endswith(".py") and importlib.util.find_spec("jax") is None:
                text = text.replace(*_JAX_IMPORT)
            if swap and target != "pyproject.toml":
                text = swap_model_references(text)
            (dest / target).parent.mkdir(parents=True, exist_ok=True)
            (dest / target).write_text(text)


def start_pytest(copy, files, keyword, backend="tensorflow"):
    """Starts pytest on `files` in the copy folder; JUnit XML and log are written beside it."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    if backend == "jax":
        # Keras's conftest: tests that enable x64 keep float32 as the default dtype.
        env["JAX_DEFAULT_DTYPE_BITS"] = "32"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", *files, "-p", "no:cacheprovider",
               "-o", "junit_family=xunit1", f"--junitxml={copy}.xml"]
    if keyword:
        command += ["-k", keyword]
    log = open(f"{copy}.log", "w")  # noqa: SIM115 - closed by the caller once pytest ends
    return subprocess.Popen(command, cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT), log


def read_junit(path):
    """Returns {test id: (outcome, first line of its error)} and {file: seconds} from JUnit XML."""
    if not path.exists():
        raise SetupError(f"pytest wrote no {path}; see {path.with_suffix('.log')}")
    results, seconds = {}, {}
    for case in ET.parse(path).iter("testcase"):
        file, classname, name = case.get("file", ""), case.get("classname", ""), case.get("name")
        module = file[: -len(".py")].replace("/", ".")
        classes = classname[len(module) + 1 :].split(".") if classname.startswith(module + ".") else []
        test_id = "::".join([file or classname, *filter(None, classes), name])
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                detail = _first_error_line(child)
        if results.get(test_id, ("passed",))[0] != "failed":  # a teardown error after a pass
            results[test_id] = (outcome, detail)
        seconds[file] = seconds.get(file, 0.0) + float(case.get("time") or 0)
    return results, seconds


def _first_error_line(element):
    message = (element.get("message") or "").strip()
    if message and message != "collection failure":
        return message.splitlines()[0]
    errors = [line[1:].strip() for line in (element.text or "").splitlines() if line.startswith("E ")]
    return errors[0] if errors else message or element.tag


def import_errors(results):
    """Returns {file: error} for the test modules that failed to import (one entry named after the module)."""
    errors = {}
    for test_id, (_, detail) in results.items():
        file, _, name = test_id.partition("::")
        if name == file.removesuffix(".py").replace("/", "."):
            errors[file] = detail
    return errors


def find_regressions(stock, swapped):
    """Returns {test id: (outcome, first error line)} for the tests that pass stock but not swapped."""
    not_imported = import_errors(swapped)
    regressions = {}
    for test_id, (outcome, _) in stock.items():
        if outcome == "passed" and swapped.get(test_id, ("",))[0] != "passed":
            file = test_id.partition("::")[0]
            regressions[test_id] = swapped.get(test_id) or ("not run", not_imported.get(file, "see swapped.log"))
    return regressions


def report(files, stock, swapped, seconds):
    """Prints the per-file table, the regressions and the common failures.

    Returns the unexpected regressions and the number of tests that pass in both copies.
    """
    def passed(results, file=None):
        return sum(1 for test_id, (outcome, _) in results.items()
                   if outcome == "passed" and (file is None or test_id.startswith(file + "::")))

    print(f"\n{'file':42} {'tests':>6} {'stock':>6} {'swapped':>8} {'stock s':>8}")
    for file in files:
        tests = sum(1 for test_id in stock if test_id.startswith(file + "::"))
        print(f"{file:42} {tests:6} {passed(stock, file):6} {passed(swapped, file):8} {seconds.get(file, 0):8.0f}")
    print(f"{'total':42} {len(stock):6} {passed(stock):6} {passed(swapped):8} {sum(seconds.values()):8.0f}")

    regressions = find_regressions(stock, swapped)
    unexpected = sorted(set(regressions) - set(EXPECTED_DIFFERENCES))
    print(f"\nREGRESSIONS (pass stock, not swapped): {len(regressions)}, unexpected: {len(unexpected)}")
    for test_id, (outcome, detail) in sorted(regressions.items()):
        reason = EXPECTED_DIFFERENCES.get(test_id)
        print(f"  {'expected' if reason else 'REGRESSION'} {test_id}\n      {outcome}: {reason or detail}")
    both = sorted(test_id for test_id, (outcome, _) in stock.items()
                  if outcome == "failed" and swapped.get(test_id, ("",))[0] != "passed")
    print(f"\nFail in both (informational): {len(both)}")
    for test_id in both:
        print(f"  {test_id}\n      {stock[test_id][1]}")
    stale = sorted(set(EXPECTED_DIFFERENCES) - set(regressions))
    if stale:
        print(f"\nEXPECTED_DIFFERENCES that no longer differ (remove them): {', '.join(stale)}")
    kept = sum(1 for test_id, (outcome, _) in stock.items()
               if outcome == "passed" and swapped.get(test_id, ("",))[0] == "passed")
    return unexpected, kept


def _passes(args):
    """[(backend, files, pytest -k expression or None)]: the passes to run, in order."""
    if args.ci:
        if args.files:
            raise SetupError("--ci runs a fixed subset; pass --files without --ci.")
        subsets = {"tensorflow": (CI_FILES, None), "jax": (JAX_CI_FILES, JAX_CI_KEYWORD)}
        backends = [args.backend] if args.backend else list(BACKENDS)
        return [(backend, list(subsets[backend][0]), _both(args.keyword, subsets[backend][1]))
                for backend in backends]
    backend = args.backend or "tensorflow"
    available = TEST_FILES if backend == "tensorflow" else JAX_FILES
    if not args.files:
        return [(backend, list(available), args.keyword)]
    by_name = {name: name for name in available} | {Path(name).stem: name for name in available}
    unknown = [name for name in args.files if name not in by_name]
    if unknown:
        raise SetupError(f"Unknown --files {unknown} on {backend}. Available: "
                         f"{', '.join(available)} (or their stems).")
    return [(backend, [by_name[name] for name in args.files], args.keyword)]


def _both(keyword, subset):
    """A pytest -k expression selecting what both `keyword` and `subset` (either may be None) select."""
    if not (keyword and subset):
        return keyword or subset
    return f"({keyword}) and ({subset})"


def _check_backend(backend):
    if backend == "jax" and importlib.util.find_spec("jax") is None:
        raise SetupError("the JAX pass needs jax, which is not installed: "
                         "pip install -c constraints.txt -e \".[jax]\" (or pass --backend tensorflow).")


def run_pass(sdist, version, backend, files, keyword, args):
    """Runs `files` stock and swapped on `backend` side by side; returns (stock, swapped, seconds, work)."""
    _check_backend(backend)
    work = Path(tempfile.mkdtemp(prefix=f"keras-conformance-{backend}-"))
    for copy, swap in (("stock", False), ("swapped", True)):
        prepare(sdist, files, work / copy, swap)
    kept_where = f"logs in {work}" if args.keep else f"logs in {work}, removed at the end; --keep keeps them"
    selected = f" (-k {keyword!r})" if keyword else ""
    print(f"\n[{backend}] keras {version}: running {len(files)} test files{selected}, stock and "
          f"swapped side by side ({kept_where}) ...", flush=True)
    runs = [start_pytest(work / copy, files, keyword, backend) for copy in ("stock", "swapped")]
    for process, log in runs:
        process.wait()
        log.close()
    (stock, seconds), (swapped, _) = (read_junit(work / f"{copy}.xml") for copy in ("stock", "swapped"))
    broken = import_errors(stock)
    if broken:
        raise SetupError(f"the stock copy could not import {broken}; see {work / 'stock.log'}")
    return stock, swapped, seconds, work


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", metavar="NAME", help="test files to run, e.g. model_test")
    parser.add_argument("--ci", action="store_true",
                        help="run the CI subsets: on TensorFlow " + ", ".join(CI_FILES)
                        + "; on JAX " + ", ".join(JAX_CI_FILES) + f" with -k {JAX_CI_KEYWORD!r}"
                        + " (both backends unless --backend)")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="Keras backend of the child pytest processes (default tensorflow; "
                        "with --ci, both)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, passed to both runs")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (copies, logs, XML)")
    args = parser.parse_args(argv)
    total_kept, total_unexpected = 0, 0
    try:
        passes = _passes(args)
        for backend, _, _ in passes:
            _check_backend(backend)
        version = importlib.metadata.version("keras")
        sdist = fetch_sdist(version)
        for backend, files, keyword in passes:
            start = time.monotonic()
            stock, swapped, seconds, work = run_pass(sdist, version, backend, files, keyword, args)
            print(f"\n[{backend}]", end="")
            unexpected, kept = report(files, stock, swapped, seconds)
            print(f"\n[{backend}] wall time {time.monotonic() - start:.0f} s for both runs.")
            if args.keep:
                print(f"Kept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
            if len(passes) > 1:
                print(f"conformance ({backend}): {kept} passed, {len(unexpected)} failed", flush=True)
            total_kept += kept
            total_unexpected += len(unexpected)
    except SetupError as error:
        print(f"conformance setup failed: {error}", file=sys.stderr)
        return 2
    # Tests passing stock and swapped, and unexpected regressions, over every pass.
    print(f"conformance: {total_kept} passed, {total_unexpected} failed")
    return 1 if total_unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
