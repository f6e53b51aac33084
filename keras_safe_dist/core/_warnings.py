"""Warnings that point at the user's line, not at Keras's or this package's."""

import os
import sys
import warnings

import keras

__all__ = ["LIBRARIES", "warn"]

# Frames in these folders are skipped. The standard library's folder holds
# site-packages, so Keras, the backend's library and every other installed
# package (pytest's too) are skipped along with this package, wherever
# installed; a virtual environment's site-packages is elsewhere, so Keras's
# backend library (imported by Keras before this package) is named too.
LIBRARIES = tuple(
    dict.fromkeys(
        os.path.dirname(path) + os.sep
        for path in (
            os.__file__,
            # the package's own folder, the one above this file's
            os.path.dirname(os.path.abspath(__file__)),
            keras.__file__,
            *(getattr(sys.modules.get(name), "__file__", None) or os.__file__ for name in ("tensorflow", "jax")),
        )
    )
)


def warn(message, category=UserWarning):
    """Warns as `warnings.warn`, attributed to the first frame outside the libraries.

    A warning raised from a callback hook or a train function then names the
    user's `fit()` line instead of Keras's callback list.

    Args:
        message: the warning's text.
        category: a `Warning` subclass.
    """
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=LIBRARIES)
        return
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(LIBRARIES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
