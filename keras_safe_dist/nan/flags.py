"""What a NaN detector asks of the train step, and the flags the step returns.

`NaNOnsetDetector` makes a `ProbeRequest`; `SafeDistributedModel.fit()` finds it
among the callbacks (`request_from`) and builds its backend's in-step checks
from it (TensorFlow's: `backend/tensorflow/nan_probe.py`). The checks return
their flags in the step's logs under `LOG_NAMES`; `decode` turns the reduced
`nonfinite_replicas` entry into a `Step`. Imports neither TensorFlow nor jax.
"""

from typing import NamedTuple

import keras

__all__ = ["LOG_NAMES", "ProbeRequest", "Step", "decode", "record_in_step", "request_from"]

LOG_NAMES = ("nonfinite_replicas", "applied_updates", "executed_steps")
MAX_REPLICAS_FOR_MASK = 16
# With B = replicas + 1 the scaled entry stays below B**4, exact in float64 up to 2**53.
MAX_REPLICAS = 8191
# Up to here the scaled entry stays below 2**14: exact in float32, even after a
# mean that multiplies by a rounded 1 / replicas.
MAX_REPLICAS_FOR_FLOAT32 = 4


class ProbeRequest(NamedTuple):
    """What a detector asks of the train step.

    A callback makes one in its `nan_probe_request()` method;
    `SafeDistributedModel` builds a `NaNProbe` from it.

    Args:
        snapshot: copy the weights and optimizer state before each step.
        count_updates: log `applied_updates`.
        action: the detector's `action` (JAX's in-step record freezes the
            state after an onset with `"stop"` and `"restore"`).
        history: the steps of loss and gradient norm kept for the report.
        check_every: on JAX, the steps between two reads of the in-step
            record.
        max_consecutive_skips: with `action="continue"`, the skipped
            updates in a row that end training.

    Example:

    ```python
    request = ProbeRequest(snapshot=True, count_updates=False)
    print(request.snapshot)  # True
    ```
    """

    snapshot: bool
    count_updates: bool
    action: str = "stop"
    history: int = 50
    check_every: int = 32
    max_consecutive_skips: int = 10


def request_from(callbacks):
    """The `ProbeRequest` of the first callback that makes one, or None.

    A callback makes one when it has a callable `nan_probe_request`
    attribute, as `NaNOnsetDetector` does.

    Args:
        callbacks: a list (possibly nested) of callbacks, a
            `keras.callbacks.CallbackList`, or None.

    Returns:
        The callback's `nan_probe_request()`, or None when no callback has
        one.

    Raises:
        ValueError: when several callbacks make one: the step keeps one
            detector's record, so the others would act on another's settings.

    Example:

    ```python
    detector = keras_safe_dist.callbacks.NaNOnsetDetector(action="restore")
    request = request_from([keras.callbacks.History(), detector])
    print(request)  # ProbeRequest(snapshot=True, count_updates=False)
    ```
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    makers = [
        callback
        for callback in keras.tree.flatten(callbacks or [])
        if callable(getattr(callback, "nan_probe_request", None))
    ]
    if len(makers) > 1:
        raise ValueError(
            f"fit() received {len(makers)} NaN onset detectors; the step keeps the "
            "record of one, so the others would report and act on its settings. "
            f"Received: {', '.join(type(c).__name__ for c in makers)} among the "
            "callbacks. Pass one NaNOnsetDetector per fit()."
        )
    return makers[0].nan_probe_request() if makers else None


def record_in_step(callbacks, enabled):
    """Tells each callback that makes a `ProbeRequest` whether the step keeps its record.

    Called by `SafeDistributedModel.fit()` before Keras builds its callback
    list: on JAX the step keeps the detector's record on the device (see
    `backend/jax/nan_watch.py`), so the detector reads no step's logs and
    Keras keeps dispatching batch hooks asynchronously.

    Args:
        callbacks: as for `request_from`.
        enabled: whether the train step keeps the record.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in keras.tree.flatten(callbacks or []):
        if callable(getattr(callback, "nan_probe_request", None)) and callable(
            getattr(callback, "record_in_step", None)
        ):
            callback.record_in_step(enabled)


class Step(NamedTuple):
    """One step's decoded flags."""

    fired: int  # number of replicas that fired
    replicas: tuple  # their ids, or () with more than 16 replicas
    inputs: int  # number of replicas whose share of the inputs is non-finite
    input_replicas: tuple  # their ids, or () with more than 16 replicas
    weights: int  # number of workers whose weights were non-finite at the step's start
    applied_updates: object  # int, or None when not requested


def decode(logs, num_replicas):
    """Decodes the probe's log entries (already reduced) into a `Step`."""
    radix = base(num_replicas)
    weights, rest = divmod(int(round(logs["nonfinite_replicas"])), radix**2)
    inputs, fired = divmod(rest, radix)
    replicas = input_replicas = ()
    if num_replicas <= MAX_REPLICAS_FOR_MASK:
        replicas = tuple(r for r in range(num_replicas) if fired >> r & 1)
        input_replicas = tuple(r for r in range(num_replicas) if inputs >> r & 1)
        fired, inputs = len(replicas), len(input_replicas)
    applied = logs.get("applied_updates")
    applied = None if applied is None else int(round(applied))
    return Step(fired, replicas, inputs, input_replicas, weights, applied)


def base(num_replicas):
    """The radix of the `nonfinite_replicas` entry for `num_replicas` replicas."""
    return 2**num_replicas if num_replicas <= MAX_REPLICAS_FOR_MASK else num_replicas + 1
