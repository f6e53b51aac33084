"""Ends this process when another process of a multi-process JAX run failed.

A process stuck in a collective does not end by itself while its peers stay
alive outside it (one raised and waits in jax's shutdown barrier, say), and
Python cannot interrupt it: signal handlers run only between bytecodes. A
thread can: `os._exit` ends the whole process at once.

The processes share a key-value store (jax's coordination service, run by
process 0). Each process's watchdog thread here:

- beats: writes a counter under `keras_safe_dist/alive/<process>` every
  `_BEAT` seconds;
- watches: reads `keras_safe_dist/failed`, which the first process to fail
  writes ("process 1: RuntimeError: ..."), and when another process wrote
  it, prints it and exits with status 1.

A process fails when an exception leaves `fit()`, `evaluate()` or
`predict()` (`report_failure`, called by the JAX trainer) or ends the
script (`sys.excepthook`); it then exits with status 1 too, skipping jax's
shutdown barrier, where it would wait for peers that are ending. When the
exception came from a collective whose peer is gone (killed, exited), the
failure names the process that stopped beating, not this one.

A process that ends its script normally waits there, at most `timeout`
seconds, for the others to end theirs (`_ENDED`): jax's shutdown barrier
would otherwise abort it ("Barrier timed out") while another process still
works. Each process counts the `fit()`, `evaluate()` and `predict()` calls it
starts (`_CALLS`, see `entering`); when another process starts a call this
one, having ended, will never make, that call would wait for it in a
collective for good: this process writes the failure, naming both, and
exits with status 1, and the other ends on reading it.

What this does not cover: process 0 killed takes the store with it, and jax
itself ends every other process within about 0.1 s, naming the coordinator
("the leader task"); a process killed with SIGKILL is noticed by the others
within `timeout` seconds (jax's heartbeat, or the collective failing).
"""

import atexit
import os
import sys
import threading
import time

import jax

from keras_safe_dist.backend.jax import _compat as _jax_compat

_FAILED = "keras_safe_dist/failed"
_ALIVE = "keras_safe_dist/alive/"
_CALLS = "keras_safe_dist/calls/"  # "<calls started> <the last one's name>"
_ENDED = "keras_safe_dist/ended/"  # the calls a process had started when its script ended
_BEAT = 1.0  # seconds between beats, and between reads of the failure key
_SILENT = 5.0  # seconds without a beat after which a process counts as gone

_state = {
    "thread": None,
    "failed_here": False,
    "stop": threading.Event(),
    "calls": 0,
    "timeout": 60.0,
}


def start(timeout):
    """Starts the watchdog thread (once per process); installs the exit hooks."""
    if _state["thread"] is not None or jax.process_count() == 1:
        return
    _state["timeout"] = float(timeout)
    thread = threading.Thread(target=_watch, name="keras_safe_dist watchdog", daemon=True)
    _state["thread"] = thread
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        previous(kind, value, traceback)
        report_failure(value)

    sys.excepthook = excepthook
    # Registered after jax's own shutdown hook, so it runs first.
    atexit.register(_at_exit)
    thread.start()


def report_failure(error):
    """Tells every process that this one failed with `error`; the first failure wins.

    Where another process failed first (its failure, or its death, is often
    what raised `error` here: a collective whose peer left), this process
    prints that failure and exits with status 1 at once.
    """
    client = _jax_compat.coordination_client()
    if client is None or _state["failed_here"]:
        return
    _state["failed_here"] = True
    process = jax.process_index()
    _end_if_another_failed(client, process)
    culprit = _silent_process(client, process)
    if culprit is not None:
        text = f"process {culprit}: stopped answering (killed or exited); process {process} saw: {_first_line(error)}"
    else:
        text = f"process {process}: {type(error).__name__}: {_first_line(error)}"
    try:
        client.key_value_set(_FAILED, text)
    except Exception:
        _end_if_another_failed(client, process)  # another process wrote it first
    if culprit is not None:
        _end(text, process)


def entering(where):
    """Tells the other processes that this one starts its next `where()` call (`"fit"`, ...)."""
    client = _jax_compat.coordination_client()
    if client is None or _state["thread"] is None:
        return
    _state["calls"] += 1
    client.key_value_set(
        f"{_CALLS}{jax.process_index()}", f"{_state['calls']} {where}", allow_overwrite=True
    )


def _end_if_another_failed(client, process):
    text = _read(client, _FAILED)
    if text is not None and not text.startswith(f"process {process}:"):
        _end(text, process)


def _end(text, process):
    print(
        f"keras_safe_dist: {text}. Ending process {process} too (exit status 1), "
        "rather than waiting for it in a collective.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    _outlive_others(process)
    os._exit(1)


def _outlive_others(process, limit=3.0):
    """Process 0 waits (at most `limit` s) for the others to exit before it does.

    It runs the key-value store: were it to exit first, jax would end the
    others with SIGABRT before they print which process failed.
    """
    if process != 0:
        return
    client = _jax_compat.coordination_client()
    others = list(range(1, jax.process_count()))
    deadline = time.monotonic() + limit
    before = _beats(client, others)
    while time.monotonic() < deadline:
        time.sleep(1.2 * _BEAT)
        now = _beats(client, others)
        if now == before:
            return  # nobody beat since: they have exited (or are stuck)
        before = now


def _at_exit():
    """A failed process exits now; otherwise it waits for the others to end, then the watchdog stops.

    The watchdog stops before jax closes the store.
    """
    process = jax.process_index()
    if not _state["failed_here"]:
        client = _jax_compat.coordination_client()
        text = _others_ended(client, process, _state["timeout"])
        if text is not None:
            _state["failed_here"] = True
            print(f"keras_safe_dist: {text}. Exit status 1.", file=sys.stderr, flush=True)
    if _state["failed_here"]:
        sys.stdout.flush()
        sys.stderr.flush()
        _outlive_others(process)
        os._exit(1)
    _state["stop"].set()
    _state["thread"].join(timeout=2 * _BEAT)


def _others_ended(client, process, timeout):
    """Waits (at most `timeout` s) for every other process to end its script.

    Returns:
        None once they all did, or the failure: another process started a
        call this one never makes (written for every process to read), or
        the bound passed.
    """
    calls = _state["calls"]
    try:
        client.key_value_set(f"{_ENDED}{process}", str(calls), allow_overwrite=True)
    except Exception:
        return None  # the store is gone: jax ends the run itself
    waiting = [p for p in range(jax.process_count()) if p != process]
    deadline = time.monotonic() + timeout
    while waiting:
        for other in list(waiting):
            if _read(client, f"{_ENDED}{other}") is not None:
                waiting.remove(other)
                continue
            started = (_read(client, f"{_CALLS}{other}") or "0 -").split()
            if int(started[0]) > calls:
                text = (
                    f"process {process}: ended its script after {calls} fit(), evaluate() or "
                    f"predict() calls while process {other} started {started[1]}() (its call "
                    f"{started[0]}), which would wait for process {process} in a collective "
                    "for good. Every process must make the same calls, in the same order"
                )
                try:
                    client.key_value_set(_FAILED, text)
                except Exception:
                    pass  # another failure was written first: it ends the others
                return text
        if _read(client, _FAILED) is not None:
            return None  # another process failed: the watchdog ends this one
        if waiting and time.monotonic() > deadline:
            names = ", ".join(str(p) for p in waiting)
            return (
                f"process {process}: ended its script and waited {timeout:.0f} s for process "
                f"{names} to end theirs; jax's shutdown would abort this process (\"Barrier "
                "timed out\"). Every process must end its script within initialize()'s "
                "`timeout` of the others: give keras_safe_dist.initialize(timeout=...) more "
                "seconds where one process works on alone at the end (saving files, say)"
            )
        time.sleep(0.1)
    return None


def _read(client, key):
    """The store's value under `key`, or None (not written, or the store is going)."""
    try:
        return client.key_value_try_get(key)
    except Exception:
        return None


def _watch():
    client = _jax_compat.coordination_client()
    process = jax.process_index()
    beat = 0
    while not _state["stop"].is_set():
        beat += 1
        try:
            client.key_value_set(f"{_ALIVE}{process}", str(beat), allow_overwrite=True)
            text = client.key_value_try_get(_FAILED)
        except Exception:
            text = None  # not written yet (or the store is going: jax ends us)
        if text is not None and not text.startswith(f"process {process}:") and not _state["failed_here"]:
            _end(text, process)
        _state["stop"].wait(_BEAT)


def _silent_process(client, process):
    """A process whose beats stopped, watched for `_SILENT` seconds; None when all beat."""
    others = [p for p in range(jax.process_count()) if p != process]
    first = _beats(client, others)
    deadline = time.monotonic() + _SILENT
    while time.monotonic() < deadline:
        time.sleep(_BEAT)
        now = _beats(client, others)
        if all(now[p] != first[p] for p in others):
            return None
    now = _beats(client, others)
    silent = [p for p in others if now[p] == first[p]]
    return silent[0] if silent else None


def _beats(client, processes):
    return {p: _read(client, f"{_ALIVE}{p}") for p in processes}


def _first_line(error):
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
