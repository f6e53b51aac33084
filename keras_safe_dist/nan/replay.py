"""What a NaN replay found, and the layer-call recording both backends' replays use.

After the in-step checks fired, each backend replays the batch once with every
layer's `call` wrapped (`wrapped_calls`): TensorFlow's replay in
`backend/tensorflow/nan_replay.py`, JAX's in `backend/jax/nan_locate.py`. A
layer is recorded when its call returns; the first layer in that order whose
output is non-finite although its floating inputs are finite is the layer that
produced the non-finite value. Imports neither TensorFlow nor jax.
"""

import contextlib
from typing import NamedTuple
from typing import Optional

from keras_safe_dist import _compat

__all__ = ["Replay", "wrapped_calls"]


class Replay(NamedTuple):
    """What the replay found.

    Attributes:
        layer: name of the first layer (in the order calls returned) whose
            output is non-finite from finite inputs, or None.
        first_nonfinite_output: name of the first layer whose output is
            non-finite at all (its inputs may already have been), or None.
        loss_finite: whether the replayed loss is finite.
        gradient_variables: paths of the variables whose gradient is
            non-finite, in the model's order.
        error: the error the replay raised, or None.
    """

    layer: Optional[str]
    first_nonfinite_output: Optional[str]
    loss_finite: Optional[bool]
    gradient_variables: tuple
    error: Optional[str]


@contextlib.contextmanager
def wrapped_calls(model, records, recording):
    """While open, each layer's `call` goes through `recording(layer, call, records)`.

    Args:
        model: the model whose layers (nested ones included) are wrapped.
        records: passed to `recording`, which appends to it.
        recording: the backend's recorder, `(layer, call, records) -> call`.
    """
    layers = _compat.flatten_layers(model)
    for layer in layers:
        object.__setattr__(layer, "call", recording(layer, layer.call, records))
    try:
        yield
    finally:
        for layer in layers:
            object.__delattr__(layer, "call")
