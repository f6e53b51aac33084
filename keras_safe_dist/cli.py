"""The `keras-safe-dist` command."""

import argparse
import json
import sys

from keras_safe_dist import launch as launch_module


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, received {text!r}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-safe-dist",
        description="Correct, observable data-parallel Keras training on tf.distribute.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser(
        "launch",
        help="run a script as several local MultiWorkerMirroredStrategy workers",
        description=(
            "Runs SCRIPT as N workers on 127.0.0.1 with free ports and a TF_CONFIG "
            "each, prefixes their output with the worker index, and kills them "
            "all when one fails or the timeout passes."
        ),
    )
    launch.add_argument("--workers", type=_positive_int, default=2, help="number of workers (default 2)")
    launch.add_argument("--timeout", type=_positive_int, default=600, help="seconds before all workers are killed (default 600)")
    launch.add_argument("script", help="Python script each worker runs")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    report = commands.add_parser(
        "report",
        help="print the findings, NaN onset and update statistics in a log directory",
        description=(
            "Reads what keras_safe_dist callbacks wrote under LOGDIR (audit "
            "reports, nan_onset.json, TensorBoard event files) and prints the "
            "findings, the NaN onset if any and the update statistics of each "
            "run. Exits 1 when findings at or above --fail-on exist."
        ),
    )
    report.add_argument("log_dir", metavar="LOGDIR", help="the log directory given to the callbacks")
    report.add_argument("--json", action="store_true", help="print JSON instead of text")
    report.add_argument(
        "--fail-on",
        choices=("warning", "error"),
        default="error",
        help="exit 1 when findings of this severity or worse exist (default error)",
    )
    return parser


def _report(args):
    from keras_safe_dist import report as report_module

    try:
        report = report_module.read_log_dir(args.log_dir)
    except FileNotFoundError as error:
        print(f"keras-safe-dist report: {error}", file=sys.stderr)
        return 2
    if not (report.audits or report.nan_onset or report.runs):
        print(
            f"keras-safe-dist report: nothing to report under {args.log_dir}: no "
            "audit_*.json, nan_onset.json or logged update statistics. Pass the "
            "log_dir given to the keras_safe_dist callbacks.",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(report.to_dict(args.fail_on), indent=2, sort_keys=True))
    else:
        print(report_module.format_text(report, args.fail_on))
    return 1 if report.failing(args.fail_on) else 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "report":
        return _report(args)
    if args.command == "launch":
        try:
            return launch_module.launch(
                args.script, workers=args.workers, args=args.script_args, timeout=args.timeout
            )
        except FileNotFoundError as error:
            print(f"keras-safe-dist launch: {error}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
