"""Kills a launcher's worker process groups when the launcher dies, even by SIGKILL.

`_workers.WorkerGroup` runs this file as a script (`python -I _reaper.py`, in a
session of its own) with its standard input a pipe of which the launcher holds
the only writing end. The launcher writes one line per event:

- `mark <id>`: the launch's mark, in every worker's environment (`MARK`);
- `add <pgid>`: a worker started, leading process group `pgid`;
- `forget <pgid>`: the launcher killed that group itself;
- `done`: the workers are all finished; exit without killing anything.

When the pipe closes without `done` (the kernel closes it when the launcher
dies, however it dies), every group still listed is killed with SIGKILL:
the workers and every process they started in their group; then every
process whose environment carries the launch's mark, which reaches the
workers' descendants that left the group (`start_new_session=True`, a
daemon) as long as they kept the environment they were given (Linux's
`/proc`; elsewhere the groups only).

Standard library only: the package is not imported here.
"""

import os
import signal
import sys

# The environment variable that marks a launch's processes.
MARK = "KERAS_SAFE_DIST_LAUNCH"


def marked(launch_id):
    """The ids of the processes whose environment carries `launch_id`'s mark, this one excepted."""
    wanted = f"{MARK}={launch_id}".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue  # gone, or another user's
    return pids


def kill_marked(launch_id):
    """SIGKILLs every process carrying `launch_id`'s mark; returns their ids."""
    pids = marked(launch_id)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def main(lines):
    """Follows the launcher's `lines`; returns the groups killed, or None after `done`."""
    groups = []
    launch_id = None
    for line in lines:
        command, _, value = line.strip().partition(" ")
        if command == "done":
            return None
        if command == "mark":
            launch_id = value
        elif command == "add":
            groups.append(int(value))
        elif command == "forget" and int(value) in groups:
            groups.remove(int(value))
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group already ended
    if launch_id:
        kill_marked(launch_id)
    return groups


if __name__ == "__main__":
    main(sys.stdin)
