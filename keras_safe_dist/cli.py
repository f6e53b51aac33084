"""The `keras-safe-dist` command."""

import argparse
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
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
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
