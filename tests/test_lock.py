"""A folder's lock (`keras_safe_dist/core/_lock.py`): one winner, stale and damaged files taken over."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from keras_safe_dist.core import _lock

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Takes the lock of one folder per round when the parent says go, says whether
# it won, and releases it when the parent says so. Imports the module alone
# (no TensorFlow), so that both processes start fast.
_CONTENDER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
base, name, rounds = sys.argv[2], sys.argv[3], int(sys.argv[4])

def wait(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit("timed out waiting for " + path)
        pass

for r in range(rounds):
    folder = os.path.join(base, str(r))
    wait(os.path.join(base, f"go_{r}"))
    try:
        held = lock.acquire(folder, "test")
        result = "won"
    except lock.FolderInUse:
        held, result = None, "lost"
    with open(os.path.join(base, f"{result}_{r}_{name}"), "w"):
        pass
    wait(os.path.join(base, f"release_{r}"))
    if held:
        lock.release(held)
"""


def _dead_pid():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_two_runs_taking_over_one_stale_lock_never_both_win(tmp_path):
    rounds = 150
    stale = json.dumps({"host": os.uname().nodename, "pid": _dead_pid(), "started": 0})
    for r in range(rounds):
        (tmp_path / str(r)).mkdir()
        (tmp_path / str(r) / _lock.LOCK_FILE).write_text(stale)
    contenders = [
        subprocess.Popen([sys.executable, "-c", _CONTENDER, _lock.__file__, str(tmp_path), name,
                          str(rounds)], stderr=subprocess.PIPE, text=True)
        for name in ("a", "b")
    ]
    winners = []
    try:
        for r in range(rounds):
            (tmp_path / f"go_{r}").touch()
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob(f"*_{r}_*"))) < 2:
                assert time.monotonic() < deadline, "a contender did not answer"
                time.sleep(0.001)
            winners.append(len(list(tmp_path.glob(f"won_{r}_*"))))
            (tmp_path / f"release_{r}").touch()
        for process in contenders:
            assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        for process in contenders:
            if process.poll() is None:
                process.kill()
    # Before: both won in 45 of 150 rounds.
    assert winners == [1] * rounds


@pytest.mark.parametrize("content", [
    '{"host": "h", "pid": 0, "started": 0}',
    '{"host": "h", "pid": -1, "started": 0}',
    '{"host": "h", "pid": true, "started": 0}',
    f'{{"host": "h", "pid": {2**40}, "started": 0}}',
    '{"host": "h", "pid": 1, "started": "abc"}',
    '{"host": "h", "pid": 1, "started": 1e20}',
    "not json",
])
def test_a_damaged_lock_file_is_taken_over(tmp_path, content):
    (tmp_path / _lock.LOCK_FILE).write_text(content)
    path = _lock.acquire(str(tmp_path), "test")
    try:
        assert json.loads(pathlib.Path(path).read_text())["pid"] == os.getpid()
    finally:
        _lock.release(path)
    assert not os.path.exists(path)


def test_a_lock_path_that_is_a_folder_is_named(tmp_path):
    (tmp_path / _lock.LOCK_FILE).mkdir()
    with pytest.raises(OSError) as error:
        _lock.acquire(str(tmp_path), "test")
    assert str(error.value) == (
        f"Damaged lock file {str(tmp_path / _lock.LOCK_FILE)!r}: it is not a regular file. "
        "Remove it if no run uses this folder."
    )


def test_a_live_holder_is_named(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _CONTENDER, _lock.__file__, str(tmp_path), "holder", "1"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        (tmp_path / "0").mkdir()
        (tmp_path / "go_0").touch()
        deadline = time.monotonic() + 60
        while not (tmp_path / "won_0_holder").exists():
            assert time.monotonic() < deadline and holder.poll() is None, holder.stderr.read()
            time.sleep(0.001)
        with pytest.raises(_lock.FolderInUse) as error:
            _lock.acquire(str(tmp_path / "0"), "MultiWorkerBackupAndRestore")
        assert f"another run holds it (process {holder.pid} on host " in str(error.value)
    finally:
        (tmp_path / "release_0").touch()
        holder.wait(timeout=60)


def test_without_flock_a_reused_process_id_does_not_keep_a_stale_lock(tmp_path):
    # Written a day before this (live) process started: another process had its id.
    (tmp_path / _lock.LOCK_FILE).write_text(json.dumps(
        {"host": os.uname().nodename, "pid": os.getppid(), "started": time.time() - 10 * 86400}
    ))
    path = os.path.join(str(tmp_path), _lock.LOCK_FILE)
    assert _lock._acquire_exclusive(str(tmp_path), path, "test") == path
    assert json.loads(pathlib.Path(path).read_text())["pid"] == os.getpid()
    _lock.release(path)


def test_without_flock_a_live_holder_keeps_its_lock(tmp_path):
    (tmp_path / _lock.LOCK_FILE).write_text(json.dumps(
        {"host": os.uname().nodename, "pid": os.getppid(), "started": time.time()}
    ))
    path = os.path.join(str(tmp_path), _lock.LOCK_FILE)
    with pytest.raises(_lock.FolderInUse, match=f"process {os.getppid()} on host"):
        _lock._acquire_exclusive(str(tmp_path), path, "test")


def test_the_holder_takes_its_lock_again(tmp_path):
    first = _lock.acquire(str(tmp_path), "test")
    try:
        assert _lock.acquire(str(tmp_path), "test") == first
    finally:
        _lock.release(first)
