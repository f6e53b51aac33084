"""The package's layout: each backend's library is imported in that backend's folder only.

A JAX user has no TensorFlow, a TensorFlow user may have no jax: a module
outside `backend/<name>/` imports neither library at module level (the
TensorFlow doctor's probes, `doctor/probes/`, run on TensorFlow only), and a
backend's folder never imports the other backend's library or folder, at any
level. Read from the source, so it holds whatever is installed.
"""

import ast
import pathlib

import keras_safe_dist

PACKAGE = pathlib.Path(keras_safe_dist.__file__).parent
LIBRARIES = ("tensorflow", "jax")
# Where a module may import each library (and its Keras backend) at module level.
ALLOWED = {
    "tensorflow": ("backend/tensorflow/", "doctor/probes/"),
    "jax": ("backend/jax/",),
}


def _imports(tree, top_level_only):
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _library(module):
    """The backend library `module` belongs to, or None."""
    for library in LIBRARIES:
        if module == library or module.startswith(
            (f"{library}.", f"keras.src.backend.{library}", f"keras_safe_dist.backend.{library}")
        ):
            return library
    return None


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def test_no_module_outside_a_backend_folder_imports_a_backend_library_at_module_level():
    misplaced = [
        f"{name} imports {module}"
        for name, tree in _modules()
        for module in _imports(tree, top_level_only=True)
        if (library := _library(module)) and not name.startswith(ALLOWED[library])
    ]
    assert misplaced == []


def test_a_backend_folder_never_imports_the_other_backend():
    crossed = [
        f"{name} imports {module}"
        for name, tree in _modules()
        for folder, other in (("backend/jax/", "tensorflow"), ("backend/tensorflow/", "jax"))
        if name.startswith(folder)
        for module in _imports(tree, top_level_only=False)
        if _library(module) == other
    ]
    assert crossed == []


def test_the_layout_check_sees_the_backend_modules():
    # The checks above would pass on an empty package: they must see both folders.
    names = [name for name, _ in _modules()]
    assert "backend/tensorflow/_update.py" in names
    assert "backend/jax/_update.py" in names
    assert _library("tensorflow.python.distribute") == "tensorflow"
    assert _library("keras_safe_dist.backend.jax.trainer") == "jax"
    assert _library("keras_safe_dist._lazy") is None
