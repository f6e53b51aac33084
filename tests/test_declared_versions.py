"""setup.cfg declares the releases CI runs, no more (docs/versions.md).

The floor of keras in `install_requires` is the keras of the floor run
(constraints-floor.txt); the `jax` extra's floors of keras and jax are the
releases the JAX suite runs with (constraints.txt, constraints-jax.txt).
"""

import configparser
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _requirements(text):
    """`{name: (lowest, below)}` of a list of `name>=a,<b` requirements."""
    bounds = {}
    for line in text.strip().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(?:,<([0-9.]+))?", line.strip())
        if match:
            bounds[match[1].lower()] = (match[2], match[3])
    return bounds


def _pins(name):
    """`{package: version}` of a constraints file."""
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9.]+)", line.strip())
        if match:
            pins[match[1].lower()] = match[2]
    return pins


def _release(version, parts):
    return tuple(int(p) for p in version.split(".")[:parts])


def _setup():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def test_the_keras_floor_is_the_floor_runs_keras():
    floor, _ = _requirements(_setup()["options"]["install_requires"])["keras"]
    assert _release(floor, 2) == _release(_pins("constraints-floor.txt")["keras"], 2)


def test_the_jax_extra_asks_for_the_keras_and_jax_the_jax_suite_runs_with():
    extra = _requirements(_setup()["options.extras_require"]["jax"])
    keras_floor, keras_below = extra["keras"]
    jax_floor, _ = extra["jax"]
    runs = [_pins("constraints.txt"), _pins("constraints-jax.txt")]
    # The lowest keras the JAX suite runs with, by minor release; none below it.
    assert _release(keras_floor, 2) == min(_release(pins["keras"], 2) for pins in runs)
    assert all(_release(pins["keras"], 2) < _release(keras_below, 2) for pins in runs)
    assert jax_floor == min((pins["jax"] for pins in runs), key=lambda v: _release(v, 3))


def test_the_jax_backends_import_check_refuses_below_the_jax_extras_keras_floor():
    # Read from the source: this process runs TensorFlow's backend, which never
    # imports the JAX one (tests/test_layout.py).
    source = (ROOT / "keras_safe_dist" / "backend" / "jax" / "__init__.py").read_text()
    checked = re.search(r"^KERAS_FLOOR = \((\d+), (\d+)\)$", source, re.MULTILINE)
    assert checked, "keras_safe_dist/backend/jax/__init__.py has no `KERAS_FLOOR = (major, minor)`"
    keras_floor, _ = _requirements(_setup()["options.extras_require"]["jax"])["keras"]
    assert (int(checked[1]), int(checked[2])) == _release(keras_floor, 2)
