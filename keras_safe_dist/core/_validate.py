"""Argument checks shared by the model and the callbacks.

Each names the argument, what was expected and what was received.
"""

import numbers
import os

from keras_safe_dist.core import _files


def is_integer_at_least(value, minimum=1):
    """Whether `value` is an integer (a NumPy one too, not a bool) >= `minimum`."""
    return (
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum
    )


def integer_at_least(name, value, minimum=1):
    """`value` as an int when it is an integer (not a bool) >= `minimum`.

    Raises:
        ValueError: otherwise.
    """
    if not is_integer_at_least(value, minimum):
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )
    return int(value)


def optional_path(name, value):
    """`value` as a str path, or None.

    Raises:
        TypeError: when `value` is neither None, a str nor an `os.PathLike`.
    """
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"`{name}` must be a path (str or os.PathLike) or None. "
            f"Received: {name}={value!r}"
        )
    return os.fspath(value)


def writable_directory(owner, name, path, optional=True):
    """Creates the directory `path` if needed and checks that a file can be written in it.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        path: the directory.
        optional: whether the argument may be None (the error then offers it).

    Raises:
        OSError: of the same kind as the failure, naming `owner`, the
            argument, the directory, the problem and what to do.
    """
    try:
        _files.check_writable(path)
    except OSError as error:
        raise type(error)(
            f"{owner} cannot write to `{name}`={path!r}: {error.strerror or error}. "
            "Pass a directory it can create and write"
            + (f", or {name}=None." if optional else ".")
        ) from error
