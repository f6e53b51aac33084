"""Kills a launcher's worker process groups when the launcher dies, even by SIGKILL.

`launch.WorkerGroup` runs this file as a script (`python -I _reaper.py`, in a
session of its own) with its standard input a pipe of which the launcher holds
the only writing end. The launcher writes one line per event:

- `add <pgid>`: a worker started, leading process group `pgid`;
- `forget <pgid>`: the launcher killed that group itself;
- `done`: the workers are all finished; exit without killing anything.

When the pipe closes without `done` (the kernel closes it when the launcher
dies, however it dies), every group still listed is killed with SIGKILL:
the workers and every process they started in their group.

Standard library only: the package is not imported here.
"""

import os
import signal
import sys


def main(lines):
    """Follows the launcher's `lines`; returns the groups killed, or None after `done`."""
    groups = []
    for line in lines:
        command, _, value = line.strip().partition(" ")
        if command == "done":
            return None
        if command == "add":
            groups.append(int(value))
        elif command == "forget" and int(value) in groups:
            groups.remove(int(value))
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group already ended
    return groups


if __name__ == "__main__":
    main(sys.stdin)
