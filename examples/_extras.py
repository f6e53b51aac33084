"""Each example's backend library, and the extra that installs it when it is missing.

The README installs one extra: `.[tensorflow]` (keras, tensorflow,
tensorboard) or `.[jax]` (keras, jax, tensorboard, no TensorFlow). An example
run in the other environment stops at its first import with one message that
names the extra and the command, instead of a bare `ModuleNotFoundError`.
"""

import importlib
import os
import sys

# From the repository's root, as in the README's "Install".
INSTALL = {
    "jax": 'pip install -c constraints.txt -e ".[jax]"',
    "tensorflow": 'pip install -c constraints.txt -e ".[tensorflow]"',
}
# What runs without the missing library.
ELSEWHERE = {
    "jax": "The TensorFlow examples need no JAX.",
    "tensorflow": (
        "examples/jax_data_parallel.py, examples/custom_loop_jax.py and "
        "examples/jax_processes.py need no TensorFlow."
    ),
}


def missing_message(library, script):
    """What `script` prints when `library` cannot be imported."""
    return (
        f"{script} needs {library}, which is not installed in this environment "
        f"(No module named {library!r}).\n"
        f"Install the [{library}] extra from the repository's root:\n"
        f"    {INSTALL[library]}\n"
        f"{ELSEWHERE[library]}"
    )


def require(library, importer=None):
    """Imports `library` (through `importer` if given) or exits with status 1 saying what to install.

    A missing module inside an installed library is not this case: its error
    is raised as it is.
    """
    try:
        return importer() if importer else importlib.import_module(library)
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != library:
            raise
        sys.exit(missing_message(library, os.path.basename(sys.argv[0])))
