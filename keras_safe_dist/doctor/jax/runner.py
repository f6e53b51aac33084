"""The JAX doctor's process: checks its devices, runs the JAX probes, prints the report.

`keras_safe_dist.doctor.jax.run()` starts it as `python -m
keras_safe_dist.doctor.jax --replicas N [--json] [--only NAME ...]` with
`KERAS_BACKEND=jax` and N JAX CPU devices. The probes run under one
`keras.distribution.DataParallel` over those devices; the report (text or
JSON), the progress lines and the exit status are the TensorFlow doctor's.
"""

import argparse
import os
import platform
import sys
import time

from keras_safe_dist.core import _json
from keras_safe_dist.core import _quiet
from keras_safe_dist.doctor import render
from keras_safe_dist.doctor.result import choose
from keras_safe_dist.doctor.result import exit_status
from keras_safe_dist.doctor.result import print_progress
from keras_safe_dist.doctor.result import run_probes

__all__ = ["main", "versions"]

_NAME = "keras-safe-dist doctor"


def versions():
    """The versions the JAX doctor ran with."""
    import jax
    import keras

    import keras_safe_dist

    return {
        "python": platform.python_version(),
        "keras": keras.__version__,
        "jax": jax.__version__,
        "keras_safe_dist": keras_safe_dist.__version__,
    }


def main(argv=None):
    """Runs the JAX probes; returns the exit status (0 passed, 1 a failure, 2 bad arguments)."""
    parser = argparse.ArgumentParser(prog="python -m keras_safe_dist.doctor.jax")
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--only", nargs="+", action="extend", metavar="NAME")
    args = parser.parse_args(argv)
    if os.environ.get("KERAS_BACKEND") != "jax":
        return _refuse(
            "this process needs KERAS_BACKEND=jax and the JAX CPU devices set before "
            "start-up; run `keras-safe-dist doctor --backend jax` instead."
        )
    # keras_safe_dist.model loads TensorFlow too; its C++ start-up lines are noise.
    with _quiet.native_stderr_silenced(not args.verbose):
        import jax
        import keras

        from keras_safe_dist.doctor.jax.probes import NOT_APPLICABLE
        from keras_safe_dist.doctor.jax.probes import PROBES
    devices = jax.devices()
    if keras.backend.backend() != "jax" or len(devices) != args.replicas:
        return _refuse(
            f"expected Keras's JAX backend on {args.replicas} CPU devices, found the "
            f"{keras.backend.backend()} backend and {len(devices)} JAX device(s). Run "
            "`keras-safe-dist doctor --backend jax`, which sets XLA_FLAGS for the "
            "device count."
        )
    try:
        probes = choose(PROBES, args.only, NOT_APPLICABLE)
    except ValueError as error:
        return _refuse(str(error))
    shown = [entry for entry in NOT_APPLICABLE if not args.only]
    found = versions()
    print(
        render.header(found, args.replicas, "jax"),
        file=sys.stderr if args.json else sys.stdout, flush=True,
    )
    distribution = keras.distribution.DataParallel(devices=devices)
    start = time.perf_counter()
    results = run_probes(probes, distribution, progress=print_progress)
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if args.json:
        document = render.to_json(found, args.replicas, results, "jax", shown)
        print(_json.dumps(document, indent=2))
    else:
        print(render.table(found, args.replicas, results, False, "jax", shown))
    return exit_status(results)


def _refuse(message):
    print(f"{_NAME}: {message}", file=sys.stderr)
    return 2
