"""The `keras-safe-dist` command: `launch`, `doctor` and `report`.

Each subcommand adds its parser in `_add_<name>` and runs in `_<name>(args)`,
which returns the exit status; bad arguments exit with status 2.
"""

import argparse
import os
import signal
import sys
import time

from keras_safe_dist.core import _json
from keras_safe_dist.core import _quiet
from keras_safe_dist.scale_out import launch as launch_module

__all__ = ["build_parser", "main"]


def _integer_at_least(minimum, why=""):
    """An argparse type accepting integers >= `minimum`."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}{why}, received {text!r}"
            )
        return value

    return parse


_positive_int = _integer_at_least(1)
_replica_count = _integer_at_least(2, " (the defects need several replicas)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-safe-dist",
        description=(
            "Correct, observable data-parallel Keras 3 training on TensorFlow "
            "(tf.distribute) and JAX (keras.distribution)."
        ),
    )
    parser.add_argument(
        "--verbose", action="store_true",
        help="also print the C++ log lines TensorFlow and JAX's XLA write at start-up "
        "(hidden by default)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_launch(commands)
    _add_doctor(commands)
    _add_report(commands)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not args.verbose:
        # TensorFlow's C++ start-up lines (CUDA probes, CPU features), read
        # when TensorFlow loads, and XLA's in jaxlib (device counts), which
        # reads the same variable; launched workers inherit it.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        code = _COMMANDS[args.command](args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (`report ... | head`): stop quietly, with
        # the status a shell gives a command ended by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


def _add_launch(commands):
    launch = commands.add_parser(
        "launch",
        help="run a script as several local workers (TensorFlow or JAX)",
        description=(
            "Runs SCRIPT as N local workers with free ports and a TF_CONFIG "
            "each (--backend tensorflow, MultiWorkerMirroredStrategy) or "
            "Keras's KERAS_DISTRIBUTION_* variables and gloo CPU collectives "
            "(--backend jax, jax.distributed); they find each other at "
            "127.0.0.1. It prefixes their output "
            "with the worker index, and kills every worker's process group "
            "when one fails, the timeout passes, or the launcher gets SIGINT, "
            "SIGTERM or SIGHUP. Exit status: 0, the first failing worker's "
            "(128+N for signal N), 124 on timeout, 128+N when the launcher got "
            "signal N, 2 for bad arguments. Note: TensorFlow's worker service "
            "and JAX's coordinator (process 0, unless JAX_COORDINATOR_BIND_ADDRESS "
            "is set) listen on every network interface, unauthenticated; use a "
            "firewall or a private network."
        ),
    )
    launch.add_argument("--workers", type=_positive_int, default=2, help="number of workers (default 2)")
    launch.add_argument("--timeout", type=_positive_int, default=600, help="seconds before all workers are killed (default 600)")
    launch.add_argument("--backend", choices=launch_module.BACKENDS, default="tensorflow", help="what the workers train with (default tensorflow)")
    launch.add_argument("script", help="Python script each worker runs")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _launch(args):
    try:
        return launch_module.launch(
            args.script,
            workers=args.workers,
            args=args.script_args,
            timeout=args.timeout,
            backend=args.backend,
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"keras-safe-dist launch: {error}", file=sys.stderr)
        return 2


def _add_doctor(commands):
    doctor = commands.add_parser(
        "doctor",
        help="compare stock Keras with SafeDistributedModel on every known defect",
        description=(
            "Prints the Python, Keras and backend versions, then runs one probe "
            "per known defect of data-parallel Keras training on N CPU devices, "
            "each comparing stock Keras with SafeDistributedModel on the same "
            "tiny model and data. --backend tensorflow (the default) splits the "
            "CPU into N logical devices under a MirroredStrategy; --backend jax "
            "runs the probes that exist on Keras's JAX backend, in a process of "
            "its own on N JAX CPU devices under keras.distribution.DataParallel, "
            "and lists the others as not applicable. Exit status: 0 when "
            "SafeDistributedModel passes every probe, 1 otherwise, 2 for bad "
            "arguments or when the backend's library (tensorflow, or jax for "
            "--backend jax) is not installed."
        ),
    )
    doctor.add_argument(
        "--backend", choices=("tensorflow", "jax"), default="tensorflow",
        help="Keras backend to probe (default tensorflow; jax needs the [jax] extra)",
    )
    doctor.add_argument(
        "--replicas", type=_replica_count, default=2,
        help="CPU devices to train on, integer >= 2 (default 2): TensorFlow's logical "
        "devices, or JAX's CPU devices",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--only", nargs="+", action="extend", metavar="NAME",
        help="run only these probes (an unknown name lists the available ones)",
    )


_native_stderr_silenced = _quiet.native_stderr_silenced

# The command installing each backend's extra, from the repository's root
# (the README's "Install").
_INSTALL = {
    "jax": 'pip install -c constraints.txt -e ".[jax]"',
    "tensorflow": 'pip install -c constraints.txt -e ".[tensorflow]"',
}


def _missing(command, library, what):
    """Says that `what` needs `library`, which is missing, and how to install it; returns 2."""
    print(
        f"keras-safe-dist {command}: {what} needs {library}, which is not installed. "
        f"Install the [{library}] extra from the repository's root: `{_INSTALL[library]}`.",
        file=sys.stderr,
    )
    return 2


def _doctor(args):
    if args.backend == "jax":
        return _doctor_jax(args)
    # Imported here: the doctor loads TensorFlow and Keras, `launch` does not.
    quiet = not args.verbose
    try:
        with _native_stderr_silenced(quiet):
            import tensorflow as tf

            from keras_safe_dist import doctor
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "tensorflow":
            raise
        code = _missing("doctor", "tensorflow", "--backend tensorflow (the default)")
        print("On JAX, run `keras-safe-dist doctor --backend jax`.", file=sys.stderr)
        return code

    # Each probe traces fresh models on purpose; retracing warnings are noise.
    tf.get_logger().setLevel("ERROR")

    try:
        probes = doctor.select(args.only)
    except ValueError as error:
        print(f"keras-safe-dist doctor: {error}", file=sys.stderr)
        return 2
    try:
        with _native_stderr_silenced(quiet):  # devices start here
            strategy = doctor.make_strategy(args.replicas)
    except RuntimeError as error:
        print(f"keras-safe-dist doctor: {error}", file=sys.stderr)
        return 2
    versions = doctor.versions()
    # The versions come first; with --json stdout holds nothing but the JSON.
    print(
        doctor.header(versions, args.replicas),
        file=sys.stderr if args.json else sys.stdout, flush=True,
    )
    start = time.perf_counter()
    results = doctor.run_probes(probes, strategy, progress=doctor.print_progress)
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if args.json:
        print(_json.dumps(doctor.to_json(versions, args.replicas, results), indent=2))
    else:
        print(doctor.table(versions, args.replicas, results, with_header=False))
    return doctor.exit_status(results)


def _doctor_jax(args):
    # Keras's backend and JAX's device count are fixed at start-up: the probes
    # run in a process of their own, which prints the report.
    from keras_safe_dist.doctor import jax as doctor_jax

    if not doctor_jax.installed():
        return _missing("doctor", "jax", "--backend jax")
    return doctor_jax.run(
        args.replicas, as_json=args.json, only=args.only, verbose=args.verbose
    )


def _add_report(commands):
    report = commands.add_parser(
        "report",
        help="print the findings, NaN onset and update statistics in a log directory",
        description=(
            "Reads what keras_safe_dist callbacks wrote under LOGDIR (audit "
            "reports, nan_onset.json, TensorBoard event files) and prints the "
            "findings, the NaN onset if any and the update statistics of each "
            "run. Exit status: 0 when no finding is at or above --fail-on, 1 "
            "otherwise, 2 for a missing log directory, one with nothing to "
            "report, or a report file it cannot read (named on stderr). "
            "Damaged event files are skipped with a warning; when they are all "
            "there is, they are named and the exit status is 2. --plot FILE.png also "
            "draws each run's update statistics and NaN onsets into that image, "
            "after the text (needs matplotlib, the [plot] extra); without "
            "matplotlib, or with no statistics to draw, the exit status is 2."
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
    report.add_argument(
        "--plot", metavar="FILE.png",
        help="also draw each run's update statistics and the NaN onsets into this image "
        "(its suffix names the format; needs the [plot] extra, matplotlib)",
    )


def _report(args):
    from keras_safe_dist import report as report_module

    if args.plot is not None:
        from keras_safe_dist.report import plot

        try:
            plot.require_matplotlib()
        except ModuleNotFoundError as error:
            print(f"keras-safe-dist report: --plot: {error}", file=sys.stderr)
            return 2
    try:
        report = report_module.read_log_dir(args.log_dir)
    except (FileNotFoundError, NotADirectoryError) as error:
        return _report_nothing(args, str(error))
    except ImportError as error:  # a remote LOGDIR without TensorFlow
        print(f"keras-safe-dist report: {error}", file=sys.stderr)
        return 2
    if not (report.audits or report.nan_onsets or report.runs or report.errors):
        if report.warnings:
            # The log directory is right; what it holds cannot be read.
            damaged = "; ".join(f"{p.path} ({p.problem})" for p in report.warnings)
            return _report_nothing(
                args,
                f"nothing readable under {args.log_dir}: no audit_*.json or "
                "nan_onset.json, and no update statistics could be read from the "
                f"damaged event files: {damaged}. Check the disk and the run that "
                "wrote them.",
            )
        return _report_nothing(
            args,
            f"nothing to report under {args.log_dir}: no audit_*.json, "
            "nan_onset.json or logged update statistics. Pass the log_dir given "
            "to the keras_safe_dist callbacks.",
        )
    if args.json:
        print(_json.dumps(report.to_dict(args.fail_on), indent=2, sort_keys=True))
    else:
        print(report_module.format_text(report, args.fail_on))
    for problem in report.warnings:
        print(f"keras-safe-dist report: skipped {problem.path}: {problem.problem}", file=sys.stderr)
    if report.warnings:
        print(_SKIPPED_NEXT, file=sys.stderr)
    for problem in report.errors:
        print(f"keras-safe-dist report: cannot read {problem.path}: {problem.problem}", file=sys.stderr)
    if report.errors:
        print(_UNREADABLE_NEXT.format(count=len(report.errors)), file=sys.stderr)
    if args.plot is not None and not _plot(args, report):
        return 2
    if report.errors:
        return 2  # the findings may be incomplete
    return 1 if report.failing(args.fail_on) else 0


_SKIPPED_NEXT = (
    "keras-safe-dist report: the statistics above stop where each skipped event file "
    "is damaged (the values before it are kept). If its run is still writing, run "
    "report again when it ends; a file damaged otherwise has lost the values after "
    "the damage."
)
_UNREADABLE_NEXT = (
    "keras-safe-dist report: the findings above leave out {count} unreadable "
    "report(s), so the exit status is 2. keras_safe_dist writes each report whole "
    "(a temporary file renamed over it), so an unreadable one was changed or replaced "
    "after it was written: move it aside and rerun what wrote it (the audit, or the "
    "fit with its callbacks) to write it again."
)


def _plot(args, report):
    """Draws the report into `args.plot`, says where on stderr; False when it could not."""
    from keras_safe_dist.report import plot

    try:
        plot.plot_report(report, args.plot)
    except (ValueError, OSError) as error:
        print(f"keras-safe-dist report: --plot: {error}", file=sys.stderr)
        return False
    print(f"keras-safe-dist report: wrote the plot to {args.plot}", file=sys.stderr)
    return True


def _report_nothing(args, reason):
    """Says why there is no report: on stderr, and with --json as a JSON document."""
    print(f"keras-safe-dist report: {reason}", file=sys.stderr)
    if args.json:
        document = {"log_dir": args.log_dir, "error": reason, "failed": None}
        print(_json.dumps(document, indent=2, sort_keys=True))
    return 2


_COMMANDS = {"launch": _launch, "doctor": _doctor, "report": _report}


if __name__ == "__main__":
    sys.exit(main())
