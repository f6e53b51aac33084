"""Keeps TensorFlow's C++ start-up lines out of the examples' output.

`import tensorflow` writes "All log messages before absl::InitializeLog()"
and CUDA probe lines to file descriptor 2 before any log level applies, and
starting the devices writes "failed call to cuInit" on a machine without a
GPU. Import TensorFlow through `import_tensorflow()` before anything else.
TensorFlow 2.18 writes the first of those lines only when a worker's
strategy starts its server: create that in `native_stderr_silenced()`.
Without TensorFlow installed, `import_tensorflow()` exits saying which extra
installs it.
"""

import contextlib
import os
import sys

from _extras import require


@contextlib.contextmanager
def native_stderr_silenced():
    """File descriptor 2 at /dev/null inside the block (Python's tracebacks come after it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def import_tensorflow():
    """`import tensorflow`, with fd 2 at /dev/null meanwhile; returns the module.

    Exits with status 1, naming the `[tensorflow]` extra, when TensorFlow is
    not installed.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # "failed call to cuInit"

    def silenced_import():
        with native_stderr_silenced():
            import tensorflow
        return tensorflow

    return require("tensorflow", silenced_import)
