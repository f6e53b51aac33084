"""A folder's lock: one run at a time, and a crashed run does not leave it stuck.

A run takes a folder by creating `LOCK_FILE` in it with `O_EXCL` (one creator
wins), holding its host name, process id and start time. Another run finding
it refuses the folder while that process lives; a lock whose process is gone
(on this host) is stale and taken over, so a crashed or killed run never
blocks the next. The process that holds a lock may take it again (a second
`fit()` after an interrupted one). Local folders only: a remote path's
lock could not tell whether its holder lives.
"""

import json
import os
import socket
import time

__all__ = ["LOCK_FILE", "FolderInUse", "acquire", "release"]

LOCK_FILE = ".keras_safe_dist.lock"


class FolderInUse(RuntimeError):
    """Another live run holds the folder's lock."""


def _holder():
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}


def _this_process(holder):
    """Whether `holder` (a lock's record, or None) is this process."""
    return holder is not None and holder["pid"] == os.getpid() and holder.get("host") == socket.gethostname()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read(path):
    """The holder recorded in `path`, or None when it is unreadable (being written, or damaged)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return None
    return holder


def acquire(folder, who):
    """Takes `folder`'s lock for this process; returns the lock file's path.

    Args:
        folder: an existing local folder.
        who: the caller, for the error (e.g. `"MultiWorkerBackupAndRestore"`).

    Raises:
        FolderInUse: when a live process (or one on another host) holds it,
            naming that process and what to do.
    """
    path = os.path.join(folder, LOCK_FILE)
    mine = _holder()
    for _ in range(3):  # a stale lock taken over, then created again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                # Being written by its creator this instant, or damaged: look again.
                time.sleep(0.05)
                holder = _read(path)
            stale = holder is None or (holder.get("host") == mine["host"] and not _alive(holder["pid"]))
            if not (_this_process(holder) or stale):
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
                raise FolderInUse(
                    f"{who} cannot use {folder!r}: another run holds it (process {holder['pid']} "
                    f"on host {holder.get('host')!r}, since {started}). Two runs writing one folder "
                    "delete each other's files and lose both runs' backups. Give this run a folder "
                    "of its own, or wait for the other to end; if it is not running (it crashed on "
                    f"another host), delete {path!r}."
                ) from None
            if _read(path) != holder:
                continue  # taken over by another process meanwhile: judge it again
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return path
    raise FolderInUse(f"{who} could not take the lock {path!r}: other processes keep taking it.")


def release(path):
    """Removes the lock at `path` if this process holds it."""
    if _this_process(_read(path)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
