"""A folder's lock: one run at a time, and a crashed run does not leave it stuck.

A run takes a folder by locking `LOCK_FILE` in it with an exclusive `flock`,
which the operating system holds for the process and drops when it ends,
however it ends: a crashed or killed run never blocks the next, and two
runs taking over one left-behind file cannot both win (the kernel gives the
lock to one). The file holds the holder's host name, process id and start
time, for the message another run gets; its content decides nothing. The
process that holds a lock may take it again (a second `fit()` after an
interrupted one). Local folders only: a remote path's lock could not tell
whether its holder lives.

Where the file system has no `flock` (or on a platform without `fcntl`) the
lock falls back to creating the file with `O_EXCL` and judging a left-behind
file by its recorded process: alive on this host, or gone (stale, taken
over), comparing the process's start time with the lock's so that a reused
process id does not keep a stale lock.
"""

import json
import os
import socket
import time

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

__all__ = ["LOCK_FILE", "FolderInUse", "acquire", "release"]

LOCK_FILE = ".keras_safe_dist.lock"

# Locks this process holds with flock: lock file's real path -> open descriptor.
_HELD = {}


class FolderInUse(RuntimeError):
    """Another live run holds the folder's lock."""


def _holder():
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}


def _read(path):
    """The holder recorded in `path`, or None when it is unreadable (being written, or damaged)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict):
        return None
    pid, started = holder.get("pid"), holder.get("started", 0)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31:
        return None
    if isinstance(started, bool) or not isinstance(started, (int, float)) or not 0 <= started < 2**40:
        return None
    return holder


def _in_use(who, folder, path, holder):
    if holder is None:
        return FolderInUse(
            f"{who} cannot use {folder!r}: another run holds it (its lock file {path!r} "
            "does not say which). Two runs writing one folder delete each other's files and "
            "lose both runs' backups. Give this run a folder of its own, or wait for the other "
            "to end."
        )
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return FolderInUse(
        f"{who} cannot use {folder!r}: another run holds it (process {holder['pid']} "
        f"on host {holder.get('host')!r}, since {started}). Two runs writing one folder "
        "delete each other's files and lose both runs' backups. Give this run a folder "
        "of its own, or wait for the other to end; if it is not running (it crashed on "
        f"another host), delete {path!r}."
    )


def _not_a_file(path):
    return OSError(
        f"Damaged lock file {path!r}: it is not a regular file. Remove it if no run uses "
        "this folder."
    )


def acquire(folder, who):
    """Takes `folder`'s lock for this process; returns the lock file's path.

    Args:
        folder: an existing local folder.
        who: the caller, for the error (e.g. `"MultiWorkerBackupAndRestore"`).

    Raises:
        FolderInUse: when a live process (or one on another host) holds it,
            naming that process and what to do.
        OSError: when the lock's path is not a regular file (a folder, say).
    """
    path = os.path.join(folder, LOCK_FILE)
    if os.path.lexists(path) and not os.path.isfile(path):
        raise _not_a_file(path)
    if os.path.realpath(path) in _HELD:
        return path  # this process holds it already
    if fcntl is not None:
        taken = _acquire_flock(folder, path, who)
        if taken:
            return path
    return _acquire_exclusive(folder, path, who)


def _acquire_flock(folder, path, who):
    """Locks `path` with flock; returns False where the file system has no flock."""
    for _ in range(10):  # the file replaced between open and lock: again
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(who, folder, path, _read(path)) from None
        except OSError:
            os.close(fd)
            return False  # no flock here (some network file systems)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False  # released (removed) by its holder meanwhile
        if not same:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_holder()).encode())
        _HELD[os.path.realpath(path)] = fd
        return True
    raise FolderInUse(f"{who} could not take the lock {path!r}: other processes keep replacing it.")


def _process_started(pid):
    """When process `pid` started, in seconds since the epoch (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(holder):
    """Whether the process that wrote `holder` still runs (on this host)."""
    pid = holder["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    started = _process_started(pid)
    # A process started after the lock was written is another one with the same id.
    return started is None or started <= holder.get("started", 0) + 1.0


def _acquire_exclusive(folder, path, who):
    """The lock without flock: `O_EXCL` creation, a stale file judged by its process."""
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
            this = holder is not None and holder["pid"] == os.getpid() and holder.get("host") == mine["host"]
            stale = holder is None or (holder.get("host") == mine["host"] and not _alive(holder))
            if not (this or stale):
                raise _in_use(who, folder, path, holder) from None
            if this:
                return path
            # A stale file is renamed aside first: of two runs taking it over,
            # one rename succeeds, and the other creates after it or fails.
            aside = f"{path}.stale.{os.getpid()}"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            if _read(aside) != holder:
                # Another run's fresh lock, renamed by mistake: put it back.
                os.rename(aside, path)
                raise _in_use(who, folder, path, _read(path)) from None
            os.remove(aside)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return path
    raise FolderInUse(f"{who} could not take the lock {path!r}: other processes keep taking it.")


def release(path):
    """Removes the lock at `path` if this process holds it."""
    fd = _HELD.pop(os.path.realpath(path), None)
    if fd is not None:
        # Removed while still locked, then unlocked: a run that opened the
        # old file meanwhile finds it replaced and opens the path again.
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        os.close(fd)
        return
    holder = _read(path)
    if holder is not None and holder["pid"] == os.getpid() and holder.get("host") == socket.gethostname():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
