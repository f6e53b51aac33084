"""Start-up cost of `import keras_safe_dist` on JAX, against `import keras, jax` alone.

Each round runs, in fresh interpreters and in alternating order, `import keras,
jax` and `import keras_safe_dist` (which imports both) with `KERAS_BACKEND=jax`,
and takes the ratio of the two wall times; the report is the median ratio with
its 95% bootstrap interval and the median extra seconds. It also says whether
either process imported TensorFlow (it must not). Run it in the environment a
JAX user has (jax, keras, tensorboard, no TensorFlow):

    PYTHONPATH=. python3 benchmarks/bench_import.py --rounds 15
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import median_interval  # noqa: E402

BASELINE = "import keras, jax, sys; print('tensorflow' in sys.modules)"
PACKAGE = "import keras_safe_dist, sys; print('tensorflow' in sys.modules)"


def _run(code):
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return time.perf_counter() - start, done.stdout.strip().splitlines()[-1] == "True"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    _run(BASELINE)  # warm the file cache for both
    _run(PACKAGE)
    ratios, extra, base_times, tensorflow = [], [], [], False
    for index in range(args.rounds):
        order = (BASELINE, PACKAGE) if index % 2 == 0 else (PACKAGE, BASELINE)
        times = {}
        for code in order:
            times[code], imported = _run(code)
            tensorflow |= imported
        ratios.append(times[PACKAGE] / times[BASELINE])
        extra.append(times[PACKAGE] - times[BASELINE])
        base_times.append(times[BASELINE])
    low, high = median_interval(ratios)
    print(f"python {sys.version.split()[0]}, {args.rounds} interleaved rounds")
    print(f"import keras, jax:     {statistics.median(base_times):.2f} s (median)")
    print(
        f"import keras_safe_dist: {statistics.median(ratios):.3f} of it "
        f"(95% interval {low:.3f}-{high:.3f}), +{statistics.median(extra):.2f} s"
    )
    print(f"tensorflow imported: {tensorflow}")


if __name__ == "__main__":
    main()
