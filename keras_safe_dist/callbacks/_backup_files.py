"""The files of a `MultiWorkerBackupAndRestore` backup: their names, the metadata, checks of the folder.

A backup is a weights file (`epoch_<N>.weights.h5`) and `training_metadata.json`,
which names it with its size and SHA-256. Files are written beside under a
temporary name, then renamed; a reader checks the metadata's shape and the
weights file's digest, and refuses a damaged backup whole.
"""

import errno
import hashlib
import json
import re
import shutil

import numpy as np

from keras_safe_dist.core import _files

__all__ = [
    "METADATA_FILE", "TMP_PREFIX", "check_room", "check_writable", "damaged", "digest",
    "estimated_size", "own_files", "read_metadata", "remove_if_empty", "weights_epoch",
    "weights_name",
]

METADATA_FILE = "training_metadata.json"

# The start of the names of files being written, before they replace theirs.
TMP_PREFIX = ".tmp"

_WEIGHTS_PATTERN = re.compile(r"^(\.tmp\d+_)?epoch_\d+\.weights\.h5$")

# The metadata is a few hundred bytes; anything much larger is not ours.
_METADATA_LIMIT = 1 << 16


def weights_name(epoch):
    return f"epoch_{epoch}.weights.h5"


# Room kept beyond the estimate: HDF5's headers, one per variable, and the metadata.
_HDF5_BYTES_PER_VARIABLE = 4096
_MARGIN_BYTES = 1 << 16


def estimated_size(model):
    """About the bytes of a weights file of `model` and its optimizer."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.weights) + list(getattr(optimizer, "variables", None) or [])
    data = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
    return data + _HDF5_BYTES_PER_VARIABLE * len(variables)


def check_room(directory, name, epoch, size, previous):
    """Raises an `OSError` (ENOSPC) when `directory`'s disk has no room for `size` bytes more.

    `previous`: whether a committed backup is there (kept), or this is the first.
    """
    if _files.remote(directory):
        return
    free = shutil.disk_usage(directory).free
    needed = size + _MARGIN_BYTES
    if free < needed:
        kept = "The previous backup is kept." if previous else "No backup was written yet."
        raise OSError(
            errno.ENOSPC,
            f"MultiWorkerBackupAndRestore cannot write the backup of epoch {epoch} to "
            f"backup_dir={directory!r}: {name} needs about {needed} bytes ({size} for the "
            f"file, {_MARGIN_BYTES} of room) and its disk has {free} bytes free. {kept} "
            "Free some space, or pass a backup_dir on a disk with room",
        )


def weights_epoch(name):
    """The epoch in a weights file's name (`epoch_<N>.weights.h5`)."""
    return int(name.split("_", 1)[1].split(".", 1)[0])


def own_files(directory):
    """The weights files (committed or half-written) and temporary files of a backup."""
    return sorted(
        name for name in _files.listdir(directory)
        if _WEIGHTS_PATTERN.match(name) or name.startswith(f"{METADATA_FILE}.tmp")
    )


def read_metadata(directory, path):
    """The backup's metadata, checked to be of the shape `MultiWorkerBackupAndRestore` writes."""
    try:
        with _files.open_file(path, "rb") as f:
            raw = f.read(_METADATA_LIMIT + 1)
        if len(raw) > _METADATA_LIMIT:
            raise ValueError(f"over {_METADATA_LIMIT} bytes")
        metadata = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise damaged(directory, METADATA_FILE, f"is not readable JSON ({error})") from error
    expected = {
        "epoch": int, "batch": int, "weights": str, "weights_bytes": int, "weights_sha256": str,
    }
    wrong = [
        key for key, kind in expected.items()
        if not isinstance(metadata, dict)
        or not isinstance(metadata.get(key), kind)
        or isinstance(metadata.get(key), bool)
    ]
    if not wrong and (
        metadata["epoch"] < 0
        or not _WEIGHTS_PATTERN.match(metadata["weights"])
        or metadata["weights"].startswith(TMP_PREFIX)
    ):
        wrong = ["epoch" if metadata["epoch"] < 0 else "weights"]
    if wrong:
        raise damaged(
            directory, METADATA_FILE,
            f"is not the metadata this callback writes (wrong or missing: "
            f"{', '.join(wrong)}; it holds {_preview(metadata)})",
        )
    return metadata


def _refuse_constant(token):
    raise ValueError(f"bare {token}")


def _preview(data):
    text = repr(data)
    return text if len(text) <= 80 else text[:77] + "..."


def damaged(directory, name, problem):
    return ValueError(
        f"MultiWorkerBackupAndRestore cannot restore the backup in "
        f"backup_dir={directory!r}: {name} {problem}. A backup restores whole or "
        f"not at all. Delete the folder {directory!r} to start training over."
    )


def digest(path):
    """`(size in bytes, SHA-256 hex digest)` of a file."""
    digest = hashlib.sha256()
    size = 0
    with _files.open_file(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            size += len(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()


def check_writable(directory):
    """Creates `directory` if needed and writes and deletes a file in it.

    Raises:
        OSError: naming the directory, the problem and what to do.
    """
    try:
        _files.check_writable(directory)
    except OSError as error:
        problem = error.strerror or str(error)
        raise OSError(
            f"MultiWorkerBackupAndRestore cannot write its backup to {directory!r}: "
            f"{problem}. Pass a `backup_dir` that every worker can create and write."
        ) from error


def remove_if_empty(directory):
    # Another worker may have removed it already: `_files.remove` allows that.
    if _files.isdir(directory) and not _files.listdir(directory):
        _files.remove(directory)
