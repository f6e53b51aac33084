"""Cost of writing TensorBoard events: tf.summary (before) against `keras_safe_dist.report._events`.

"point": the Dashboard's per-update point, one Summary holding the four update
statistics (descriptions with the first value of the file only), written as
`Dashboard._write_updates` wrote it with tf.summary
(`tf.summary.experimental.write_raw_pb` into a `tf.summary.create_file_writer`
writer) and as it writes it now (`_events.EventFileWriter.write`). Each round
writes `--points` points with each writer, then flushes (a Dashboard flushes at
each epoch end); the two alternate, the first of a round rotating, after a
warm-up round of each. Reported: the median over rounds of the time per point,
and the median of the per-round ratios after / before.

"events": the events of one `summaries.write_report` of an audit report with 8
findings (its markdown table as text, about 0.9 KB, and 3 scalar counts, then
the flush), as written with tf.summary and as now, one call each alternately.
"write_report": the whole call, the JSON file too (written whole, with an
fsync, which makes most of the time and its noise).

"import": seconds to import `keras_safe_dist/report/_events.py` in a fresh Python
process (the module file alone, as tests/test_events.py loads it).

Usage:
    PYTHONPATH=. python benchmarks/bench_events.py [--rounds 5] [--points 500] [--reports 51] [--json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402  (the "before" writer)
from tensorboard.compat.proto import summary_pb2  # noqa: E402
from tensorboard.compat.proto import tensor_pb2  # noqa: E402
from tensorboard.compat.proto import tensor_shape_pb2  # noqa: E402
from tensorboard.compat.proto import types_pb2  # noqa: E402
from tensorboard.plugins.scalar import metadata as scalar_metadata  # noqa: E402

from keras_safe_dist.findings import AuditReport  # noqa: E402
from keras_safe_dist.findings import Finding  # noqa: E402
from keras_safe_dist.report import _events  # noqa: E402
from keras_safe_dist.report import writer as summaries  # noqa: E402
from keras_safe_dist.update.statistics import STATISTICS  # noqa: E402
from keras_safe_dist.update.statistics import UPDATE_PREFIX  # noqa: E402
from keras_safe_dist.update.statistics import description  # noqa: E402

from _timing import no_collection  # noqa: E402

BEFORE, AFTER = "before (tf.summary)", "after (_events)"


def _metadata():
    return {
        name: scalar_metadata.create_summary_metadata(display_name=name, description=description(name, per_update=True))
        for name in STATISTICS
    }


def _logs(step):
    return {name: 0.001 * step + i for i, name in enumerate(STATISTICS)}


class TfSummaryPoints:
    """The Dashboard's points as written before, with tf.summary."""

    def __init__(self, log_dir):
        self.writer = tf.summary.create_file_writer(log_dir)
        self.metadata = _metadata()

    @staticmethod
    def _float_tensor(value):
        return tensor_pb2.TensorProto(
            dtype=types_pb2.DT_FLOAT, float_val=[float(value)], tensor_shape=tensor_shape_pb2.TensorShapeProto()
        )

    def point(self, step, logs):
        values = _values(self.metadata, logs, self._float_tensor)
        with self.writer.as_default():
            tf.summary.experimental.write_raw_pb(summary_pb2.Summary(value=values).SerializeToString(), step=step)

    def flush(self):
        self.writer.flush()


def _values(metadata, logs, float_tensor):
    """A point's values, as the Dashboard builds them; each description sent once."""
    return [
        summary_pb2.Summary.Value(
            tag=f"{UPDATE_PREFIX}/{name}", metadata=metadata.pop(name, None), tensor=float_tensor(logs[name])
        )
        for name in STATISTICS
    ]


class EventsPoints:
    """The Dashboard's points as written now, with `_events`."""

    def __init__(self, log_dir):
        self.writer = _events.EventFileWriter(log_dir)
        self.metadata = _metadata()

    def point(self, step, logs):
        self.writer.write(step, _values(self.metadata, logs, _events.float_tensor))

    def flush(self):
        self.writer.flush()


def _tf_summary_write_summaries(log_dir, step, texts, scalars):
    """`summaries._write_summaries` as it was, with tf.summary (one writer per log directory)."""
    writer = _TF_WRITERS.get(log_dir) or _TF_WRITERS.setdefault(log_dir, tf.summary.create_file_writer(log_dir))
    with writer.as_default():
        for tag, markdown in texts.items():
            tf.summary.text(tag, markdown, step=step)
        for tag, value in scalars.items():
            tf.summary.scalar(tag, value, step=step)
    writer.flush()


def _tf_summary_write_report(log_dir, report, step=0):
    """`summaries.write_report` as it was, with tf.summary."""
    name = report.name.replace(" ", "_")
    texts = {f"audits/{name}": report.to_markdown()}
    scalars = {f"audits/{name}/{sev}": n for sev, n in report.counts().items()}
    _tf_summary_write_summaries(log_dir, step, texts, scalars)
    summaries._write_json(log_dir, f"audit_{name}.json", report.to_dict())


_TF_WRITERS = {}


def _report():
    findings = [
        Finding.of("AGG003", f"model/dense_{i}/counter", "on-write variable with sum aggregation.", "Use mean.")
        for i in range(8)
    ]
    return AuditReport("aggregation", findings)


def time_points(rounds, points, root):
    writers = {BEFORE: TfSummaryPoints(f"{root}/tf"), AFTER: EventsPoints(f"{root}/ev")}
    names = list(writers)
    steps = {name: 0 for name in names}
    times = {name: [] for name in names}
    for round_ in range(-1, rounds):  # round -1: warm-up
        shift = max(round_, 0) % len(names)
        for name in names[shift:] + names[:shift]:
            writer = writers[name]
            logs = [_logs(steps[name] + i) for i in range(points)]
            with no_collection():
                start = time.perf_counter()
                for i in range(points):
                    writer.point(steps[name] + i + 1, logs[i])
                writer.flush()
                seconds = time.perf_counter() - start
            steps[name] += points
            if round_ >= 0:
                times[name].append(seconds / points)
    return times


def time_reports(count, root):
    """Seconds of each call: the report's events alone (text, scalars, flush), and the
    whole `write_report` (the events, then the JSON file, written whole with an fsync)."""
    report = _report()
    texts = {"audits/aggregation": report.to_markdown()}
    scalars = {f"audits/aggregation/{sev}": n for sev, n in report.counts().items()}
    calls = {
        "events": {
            BEFORE: lambda step: _tf_summary_write_summaries(f"{root}/tf_events", step, texts, scalars),
            AFTER: lambda step: summaries._write_summaries(f"{root}/ev_events", step, texts, scalars),
        },
        "write_report": {
            BEFORE: lambda step: _tf_summary_write_report(f"{root}/tf_reports", report, step),
            AFTER: lambda step: summaries.write_report(f"{root}/ev_reports", report, step=step),
        },
    }
    times = {}
    for what, pair in calls.items():
        times[what] = {name: [] for name in pair}
        for i in range(-1, count):  # call -1: warm-up
            order = [BEFORE, AFTER] if i % 2 else [AFTER, BEFORE]
            for name in order:
                with no_collection():
                    start = time.perf_counter()
                    pair[name](max(i, 0))
                    seconds = time.perf_counter() - start
                if i >= 0:
                    times[what][name].append(seconds)
    return times, len(texts["audits/aggregation"].encode())


def time_import():
    code = (
        "import importlib.util, sys, time\n"
        "start = time.perf_counter()\n"
        "spec = importlib.util.spec_from_file_location('events_alone', sys.argv[1])\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(time.perf_counter() - start, 'tensorflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, _events.__file__], capture_output=True, text=True, check=True)
    seconds, tensorflow = out.stdout.split()
    return float(seconds), tensorflow == "True"


def summarize(times):
    before, after = times[BEFORE], times[AFTER]
    return {
        "before_median_ms": 1e3 * statistics.median(before),
        "after_median_ms": 1e3 * statistics.median(after),
        "median_ratio_after_over_before": statistics.median(a / b for a, b in zip(after, before)),
        "before_ms": [1e3 * t for t in before],
        "after_ms": [1e3 * t for t in after],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--points", type=int, default=500)
    parser.add_argument("--reports", type=int, default=51)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        points = summarize(time_points(args.rounds, args.points, root))
        report_times, markdown_bytes = time_reports(args.reports, root)
        import_s, imported_tf = time_import()
    rows = {"point": points, **{what: summarize(t) for what, t in report_times.items()}}
    result = {
        "points_per_round": args.points,
        "rounds": args.rounds,
        "report_calls": args.reports,
        "markdown_bytes": markdown_bytes,
        **rows,
        "import": {"seconds": import_s, "tensorflow_imported": imported_tf},
    }
    if args.json:
        print(json.dumps(result))
        return
    for what, row in rows.items():
        print(
            f"{what:12s}: before {row['before_median_ms']:.3f} ms, after {row['after_median_ms']:.3f} ms, "
            f"median ratio after/before {row['median_ratio_after_over_before']:.3f}"
        )
    print(
        f"points per round: {args.points}, rounds: {args.rounds}; "
        f"report calls: {args.reports}, markdown {markdown_bytes} bytes"
    )
    print(f"import of report/_events.py alone: {import_s:.3f} s, tensorflow imported: {imported_tf}")


if __name__ == "__main__":
    main()
