"""Writing reports into a run's log directory, from the chief only.

TensorBoard reads what is written here: markdown as text summaries and counts
as scalar summaries, written as `tf.summary.text` and `tf.summary.scalar`
write them but with the `tensorboard` package alone (`keras_safe_dist.report._events`:
no TensorFlow needed). The same reports are also written as JSON, so that
`keras-safe-dist report LOGDIR` can read them back without TensorBoard.
Under multi-worker training only the chief writes; the other workers' calls
return without touching the file system. Callbacks run outside the strategy's
scope, so they pass the model's `distribute_strategy` to tell who the chief is.

Each function takes `who`, the callback or function writing: a write that fails
(a full disk, a `log_dir` replaced by a file) raises an `OSError` naming it and
the folder, and an event file removed during training (its folder deleted) is
written anew there, with a warning naming it, once per folder.
"""

import atexit
import contextlib
import os
import threading

from keras_safe_dist.core import _files
from keras_safe_dist.core import _json
from keras_safe_dist.core import _warnings
from keras_safe_dist.report import _events
from keras_safe_dist.scale_out.distributed import is_chief

__all__ = ["write_json", "write_report", "write_scalars", "write_text", "writing"]


@contextlib.contextmanager
def writing(who, log_dir):
    """Re-raises an `OSError` of a write into `log_dir` as one naming `who` and `log_dir`."""
    try:
        yield
    except OSError as error:
        what = f"{error.strerror or error}" + (f": {error.filename!r}" if error.filename else "")
        message = (
            f"{who} could not write to log_dir={os.fspath(log_dir)!r} ({what}). Free some "
            "space, or pass a log_dir it can create and write."
        )
        raise (OSError(error.errno, message) if error.errno else OSError(message)) from error


def write_text(log_dir, tag, markdown, step=0, strategy=None, who="keras_safe_dist"):
    """Writes `markdown` as a text summary under `tag`; chief only."""
    if is_chief(strategy):
        with writing(who, log_dir):
            _write_summaries(log_dir, step, who, texts={tag: markdown})


def write_scalars(log_dir, scalars, step=0, strategy=None, who="keras_safe_dist"):
    """Writes each `{tag: value}` as a scalar summary; chief only."""
    if is_chief(strategy):
        with writing(who, log_dir):
            _write_summaries(log_dir, step, who, scalars=scalars)


def write_json(log_dir, filename, data, strategy=None, who="keras_safe_dist"):
    """Writes `data` as indented strict JSON to `log_dir/filename`; chief only.

    Non-finite numbers are written as strings (see `keras_safe_dist.core._json`),
    and the file is replaced whole.

    Returns:
        The path written, or None on a worker that is not the chief.
    """
    if not is_chief(strategy):
        return None
    with writing(who, log_dir):
        return _write_json(log_dir, filename, data)


def write_report(log_dir, report, step=0, extra=None, strategy=None, who="keras_safe_dist"):
    """Writes an `AuditReport` to `log_dir`; chief only.

    Writes the markdown table as text under `audits/<name>`, the count of
    findings per severity as scalars under `audits/<name>/<severity>`, and
    `audit_<name>.json` (the report's `to_dict()`, plus `extra` if given).
    """
    if not is_chief(strategy):
        return
    name = report.name.replace(" ", "_")
    with writing(who, log_dir):
        _write_summaries(
            log_dir,
            step,
            who,
            texts={f"audits/{name}": report.to_markdown()},
            scalars={f"audits/{name}/{sev}": n for sev, n in report.counts().items()},
        )
        _write_json(log_dir, f"audit_{name}.json", {**report.to_dict(), **(extra or {})})


def _write_summaries(log_dir, step, who, texts=None, scalars=None):
    # One event per value, as tf.summary.text and tf.summary.scalar write them.
    writer = _writer(log_dir, who)
    for tag, markdown in (texts or {}).items():
        writer.write(step, [_events.text(tag, markdown)])
    for tag, value in (scalars or {}).items():
        writer.write(step, [_events.scalar(tag, value)])
    writer.flush()


def _write_json(log_dir, filename, data):
    _files.makedirs(log_dir)
    return _json.write(os.path.join(log_dir, filename), data)


# One writer per log directory for the life of the process. A writer per
# write made one event file per write; TensorBoard reads a directory's event
# files in name order, which within a second is not the order they were
# written, and drops the steps it then sees "go back".
_WRITERS = {}
_WRITERS_LOCK = threading.Lock()


@atexit.register
def _close_writers():
    with _WRITERS_LOCK:
        for writer in _WRITERS.values():
            writer.close()
        _WRITERS.clear()


def _writer(log_dir, who):
    """The log directory's event file writer, kept open for the next write."""
    log_dir = os.fspath(log_dir)
    remote = _files.remote(log_dir)
    key = log_dir if remote else os.path.abspath(log_dir)
    with _WRITERS_LOCK:
        writer = _WRITERS.get(key)
        # A local file removed since (its directory with it): start a new one.
        # A remote file is not looked for: that would cost a round trip per write.
        if writer is None or not (remote or os.path.exists(writer.path)):
            if writer is not None:
                writer.close()
                warn_recreated(who, writer.path, log_dir)
            writer = _WRITERS[key] = _events.EventFileWriter(log_dir)
        return writer


_WARNED_RECREATED = set()


def warn_recreated(who, path, log_dir):
    """Warns, once per folder, that the event file `path` went and a new one is written."""
    key = os.path.abspath(os.fspath(log_dir))
    if key in _WARNED_RECREATED:
        return
    _WARNED_RECREATED.add(key)
    _warnings.warn(
        f"{who}: the event file {path!r} was removed during training (log_dir={os.fspath(log_dir)!r} "
        "deleted?). A new event file is written there from now on; what the removed one held "
        "is lost."
    )
