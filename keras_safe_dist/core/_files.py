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
import tempfile

from keras_safe_dist.core._lazy import LazyModule

# Imported for a remote path only: a JAX user without TensorFlow keeps local paths.
tf = LazyModule("tensorflow", "A remote path (gs://, s3://: read and written through tf.io.gfile)", "tensorflow")

__all__ = [
    "check_writable", "exists", "isdir", "listdir", "makedirs", "open_file", "remote", "remove",
    "rename", "walk", "written_whole",
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


def check_writable(path):
    """Creates the folder `path` if needed and writes a file in it, then removes it.

    Raises the `OSError` of whichever step fails. A local check writes an
    unnamed temporary file; a remote file system (`gs://`) has none, so a
    named one is written and removed.
    """
    makedirs(path)
    if not remote(path):
        with tempfile.TemporaryFile(dir=path):
            return
    probe = f"{path.rstrip('/')}/.keras_safe_dist_write_check_{os.getpid()}"
    with open_file(probe, "w") as f:
        f.write("")
    remove(probe)


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
    """A file object whose content replaces `path` in one step when the block ends.

    The content goes to a file beside `path` (flushed to disk, for a local
    one), which then replaces `path`: a reader sees the previous file or the
    new one, never half of one. When the block raises, `path` is left as it
    was and the file beside it removed. A remote `path` is written through
    TensorFlow's `GFile` and put in place with `tf.io.gfile.rename`.

    Args:
        path: the file to write, local or remote.
        mode: `"w"` (text, UTF-8) or `"wb"`.

    Example:

    ```python
    with written_whole("report.json") as f:
        f.write(text)
    ```
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        if remote(path):
            with open_file(tmp, mode) as f:
                yield f
            rename(tmp, path)
            return
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)  # nothing if it is gone
        raise


def walk(path):
    """`os.walk(path)`, top-down, or `tf.io.gfile.walk` for a remote path.

    Yields `(folder, subfolders, files)`; nothing when `path` does not exist.
    """
    if not remote(path):
        yield from os.walk(path)
        return
    with _gfile_errors():
        yield from tf.io.gfile.walk(path)
