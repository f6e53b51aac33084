"""File operations on local and remote paths, without TensorFlow for local ones.

A local path goes through `os` and `shutil`. A remote one (`gs://`, `s3://`,
anything with `://`) goes through TensorFlow's `tf.io.gfile`, which is what
reads and writes such paths, imported only then. Errors are `OSError`s on
both: TensorFlow's `NotFoundError` becomes `FileNotFoundError`, its other
errors `OSError`, each with TensorFlow's message.
"""

import contextlib
import os
import shutil

from keras_safe_dist.core._lazy import tensorflow as tf

__all__ = [
    "exists", "isdir", "listdir", "makedirs", "open_file", "remote", "remove", "rename",
    "written_whole",
]


def remote(path):
    """Whether `path` names a remote filesystem (`scheme://...`)."""
    return "://" in os.fspath(path)


@contextlib.contextmanager
def _gfile_errors():
    """Raises TensorFlow's file errors as `OSError`s."""
    try:
        yield
    except tf.errors.NotFoundError as error:
        raise FileNotFoundError(error.message) from error
    except tf.errors.OpError as error:
        raise OSError(error.message) from error


def makedirs(path):
    """Creates `path` and its parents; nothing if it exists."""
    if not remote(path):
        os.makedirs(path, exist_ok=True)
        return
    with _gfile_errors():
        tf.io.gfile.makedirs(path)


def exists(path):
    """Whether `path` exists."""
    if not remote(path):
        return os.path.exists(path)
    with _gfile_errors():
        return tf.io.gfile.exists(path)


def isdir(path):
    """Whether `path` is a directory."""
    if not remote(path):
        return os.path.isdir(path)
    with _gfile_errors():
        return tf.io.gfile.isdir(path)


def listdir(path):
    """The names in directory `path`; `[]` when it does not exist."""
    try:
        if not remote(path):
            return os.listdir(path)
        with _gfile_errors():
            return tf.io.gfile.listdir(path)
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def open_file(path, mode):
    """`open(path, mode)`, or TensorFlow's `GFile` for a remote path."""
    if not remote(path):
        with open(path, mode) as f:
            yield f
        return
    with _gfile_errors(), tf.io.gfile.GFile(path, mode) as f:
        yield f


def rename(source, target):
    """Puts `source` in place of `target` in one step (a local file is synced first)."""
    if remote(target):
        with _gfile_errors():
            tf.io.gfile.rename(source, target, overwrite=True)
        return
    with open(source, "rb") as f:
        os.fsync(f.fileno())
    os.replace(source, target)


def remove(path):
    """Removes the file or directory tree `path`; nothing if it is gone."""
    try:
        if not remote(path):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            return
        with _gfile_errors():
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            else:
                tf.io.gfile.remove(path)
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def written_whole(path, mode="w"):
    """A local file object whose content replaces `path` in one step when the block ends.

    The content goes to a file beside `path`, flushed to disk, which then
    replaces `path`: a reader sees the previous file or the new one, never
    half of one. When the block raises, `path` is left as it was and the
    file beside it removed.

    Args:
        path: the local file to write.
        mode: `"w"` (text, UTF-8) or `"wb"`.

    Example:

    ```python
    with written_whole("report.json") as f:
        f.write(text)
    ```
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
