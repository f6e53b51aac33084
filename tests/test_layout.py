"""The package's layout, read from the source, so it holds whatever is installed.

- Each backend's library is imported in that backend's folder only. A JAX user
  has no TensorFlow, a TensorFlow user may have no jax: a module outside
  `backend/<name>/` imports neither library at module level (the TensorFlow
  doctor's probes, `doctor/probes/`, run on TensorFlow only), and a backend's
  folder never imports the other backend's library or folder, at any level.
- Private Keras, TensorFlow and jax APIs (`keras.src`, `tensorflow.python`,
  `jax._src`) are imported by the compatibility modules only, at any level:
  `_compat.py` (the backend-neutral ones) and each backend's `_compat.py`.
- No import cycle, counting the imports inside functions (a lazy import that
  goes back up is the same cycle, hidden), and counting the package
  `__init__` that importing `a.b.c` runs when `a.b` is another folder's.
- At most 10 modules at the package's root; `core/` imports nothing of the
  package outside itself.
"""

import ast
import collections
import pathlib

import keras_safe_dist

PACKAGE = pathlib.Path(keras_safe_dist.__file__).parent
LIBRARIES = ("tensorflow", "jax")
# Where a module may import each library (and its Keras backend) at module level.
ALLOWED = {
    "tensorflow": ("backend/tensorflow/", "doctor/probes/"),
    "jax": ("backend/jax/",),
}
PRIVATE = ("keras.src", "tensorflow.python", "jax._src")
COMPAT = ("_compat.py", "backend/tensorflow/_compat.py", "backend/jax/_compat.py")


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


def _private(module):
    return module in PRIVATE or module.startswith(tuple(f"{name}." for name in PRIVATE))


def test_private_apis_are_imported_by_the_compatibility_modules_only():
    misplaced = [
        f"{name} imports {module}"
        for name, tree in _modules()
        if name not in COMPAT
        for module in _imports(tree, top_level_only=False)
        if _private(module)
    ]
    assert misplaced == []


def test_the_layout_check_sees_the_backend_modules():
    # The checks above would pass on an empty package: they must see both folders.
    names = [name for name, _ in _modules()]
    assert "backend/tensorflow/_update.py" in names
    assert "backend/jax/_update.py" in names
    assert _library("tensorflow.python.distribute") == "tensorflow"
    assert _library("keras_safe_dist.backend.jax.trainer") == "jax"
    assert _library("keras_safe_dist.core._lazy") is None
    # The private-API check sees each compatibility module's imports.
    imported = {name: set(_imports(tree, top_level_only=False)) for name, tree in _modules() if name in COMPAT}
    assert sorted(imported) == sorted(COMPAT)
    assert "keras.src.trainers" in imported["_compat.py"]
    assert "tensorflow.python.distribute" in imported["backend/tensorflow/_compat.py"]
    assert "keras.src.backend.jax" in imported["backend/jax/_compat.py"]
    assert all(map(_private, ["keras.src", "keras.src.losses", "jax._src.core", "tensorflow.python"]))
    assert not _private("keras.srcs") and not _private("keras") and not _private("tensorflow")


ROOT_MODULES_AT_MOST = 10


def _dotted(name):
    """`"audits/scope.py"` -> `"keras_safe_dist.audits.scope"`; a folder's `__init__` is the folder."""
    parts = ["keras_safe_dist", *name[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """`{module: set of package modules it imports}`, from every import statement at any level."""
    modules = {_dotted(name): (name, tree) for name, tree in _modules()}

    def resolve(dotted):
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = collections.defaultdict(set)
    for module, (name, tree) in modules.items():
        # The folder a module is in: its imports of that folder's package run nothing new.
        home = module if name.endswith("__init__.py") else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                ]
            else:
                targets = []
            for target in targets:
                found = resolve(target) if target.startswith("keras_safe_dist") else None
                if found is None or found == module:
                    continue
                graph[module].add(found)
                parts = found.split(".")
                for end in range(2, len(parts)):
                    package = ".".join(parts[:end])
                    if package in modules and not (home == package or home.startswith(package + ".")):
                        graph[module].add(package)
    return modules, graph


def _cycles(graph, nodes):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_counting_imports_inside_functions():
    modules, graph = _import_graph()
    assert _cycles(graph, modules) == []


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import_and_a_package_init():
    # The check above would pass on a graph it cannot read: it must see these.
    _, graph = _import_graph()
    assert "keras_safe_dist.backend.jax.trainer" in graph["keras_safe_dist.model"]
    assert "keras_safe_dist.core" in graph["keras_safe_dist.nan.callback"]
    modules = ["a", "a.b", "c"]
    assert _cycles({"a": {"c"}, "c": {"a.b"}, "a.b": set()}, modules) == []
    assert _cycles(collections.defaultdict(set, {"a": {"c"}, "c": {"a.b"}, "a.b": {"a"}}), modules) == [
        ["a", "a.b", "c"]
    ]


def test_the_package_root_holds_at_most_10_modules():
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, root


def test_core_imports_nothing_of_the_package_outside_itself():
    _, graph = _import_graph()
    outside = {
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == "keras_safe_dist.core" or module.startswith("keras_safe_dist.core.")
        for target in targets
        if not target.startswith("keras_safe_dist.core")
    }
    # A module imported later by its name (`LazyModule("keras_safe_dist....")`) counts too.
    named = {
        f"{name} names {node.value}"
        for name, tree in _modules()
        if name.startswith("core/")
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if node.value.startswith("keras_safe_dist.") and not node.value.startswith("keras_safe_dist.core")
    }
    assert outside | named == set()
