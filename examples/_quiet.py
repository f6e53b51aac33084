"""Keeps TensorFlow's C++ start-up lines out of the examples' output.

`import tensorflow` writes "All log messages before absl::InitializeLog()"
and CUDA probe lines to file descriptor 2 before any log level applies, and
starting the devices writes "failed call to cuInit" on a machine without a
GPU. Import TensorFlow through `import_tensorflow()` before anything else.
"""

import os
import sys


def import_tensorflow():
    """`import tensorflow`, with fd 2 at /dev/null meanwhile; returns the module."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # "failed call to cuInit"
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        import tensorflow
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return tensorflow
