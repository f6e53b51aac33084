"""Each backend's step behind one `SafeDistributedModel`, as Keras keeps one trainer per backend.

`Trainer` is the mixin of the backend Keras runs on:
keras_safe_dist/backend/tensorflow/trainer.py or keras_safe_dist/backend/jax/trainer.py.
Each backend's folder holds every part of its step (its update, its private APIs, its
NaN checks) and is imported on that backend only: TensorFlow's never on JAX, jax's
never on TensorFlow. The rule they share lives outside (`_loss.py`, `_stats.py`,
`model.py`); `tests/test_layout.py` checks the split.
"""

import keras

_BACKEND = keras.backend.backend()

if _BACKEND == "tensorflow":
    from keras_safe_dist.backend.tensorflow.trainer import TensorFlowTrainer as Trainer
elif _BACKEND == "jax":
    from keras_safe_dist.backend.jax.trainer import JAXTrainer as Trainer
else:
    raise ImportError(
        "keras_safe_dist trains on Keras's TensorFlow and JAX backends. "
        f"Received: KERAS_BACKEND={_BACKEND!r}. Set KERAS_BACKEND=tensorflow "
        "or KERAS_BACKEND=jax before importing keras."
    )

__all__ = ["Trainer"]
