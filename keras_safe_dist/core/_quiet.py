"""TensorFlow's C++ start-up lines, kept out of a program's output.

`import tensorflow` writes "All log messages before absl::InitializeLog()"
and a CUDA-driver probe line to file descriptor 2 before any log level
applies (measured with TensorFlow 2.21.0: with `TF_CPP_MIN_LOG_LEVEL=3` too);
starting the devices then writes "failed call to cuInit ... (303)" on a
machine without a GPU, which `TF_CPP_MIN_LOG_LEVEL=3` does silence
(`CUDA_VISIBLE_DEVICES=""` does not).
"""

import contextlib
import os
import sys

__all__ = ["native_stderr_silenced"]


@contextlib.contextmanager
def native_stderr_silenced(silenced=True):
    """Points file descriptor 2 at /dev/null inside the block.

    Python's own `sys.stderr` is flushed first; an exception raised inside
    the block is reported after it, when the descriptor is back.

    Args:
        silenced: False leaves stderr alone (a `--verbose` flag).
    """
    if not silenced:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
