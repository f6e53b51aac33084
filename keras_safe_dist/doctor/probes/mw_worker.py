"""One worker of the `multi-worker-fit` probe: `python -m keras_safe_dist.doctor.probes.mw_worker`.

Started twice by the probe, each time with its own `TF_CONFIG` on 127.0.0.1.
Creates its MultiWorkerMirroredStrategy before any TensorFlow op, then fits
the tiny model with stock `keras.Model` and with SafeDistributedModel (the
sides named by `--sides`, in order) and prints one `RESULT <json>` line per
side: `{"side", "ok", "figure"}`, the figure being the relative deviation of
the update from one device, or the error.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

__all__ = ["main"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mw_worker")
    parser.add_argument("--sides", default="stock,safe")
    args = parser.parse_args(argv)
    # The strategy must exist before any other TensorFlow op.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    import keras

    from keras_safe_dist.core import _json
    from keras_safe_dist.doctor.probe import TOLERANCE
    from keras_safe_dist.doctor.probe import Side
    from keras_safe_dist.doctor.probe import measure
    from keras_safe_dist.doctor.probes import _tiny
    from keras_safe_dist.model import SafeDistributedModel

    replicas = strategy.num_replicas_in_sync
    x, y = _tiny.data(4 * replicas)
    batch = 2 * replicas  # two even global batches
    reference = _tiny.mlp(keras.Model, _tiny.one_device())
    start = reference.get_weights()
    expected = _tiny.update(reference, _tiny.one_device(), x, y, batch)
    classes = {"stock": keras.Model, "safe": SafeDistributedModel}

    def side(cls):
        model = _tiny.mlp(cls, strategy, weights=start)
        value = _tiny.relative_deviation(expected, _tiny.update(model, strategy, x, y, batch))
        return Side(value <= TOLERANCE, value)

    for name in args.sides.split(","):
        result = measure(lambda cls=classes[name]: side(cls))
        print("RESULT " + _json.dumps({"side": name, **result.to_json()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
