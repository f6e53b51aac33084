"""Each backend's step behind one `SafeDistributedModel`, as Keras keeps one trainer per backend.

`Trainer` is the mixin of the backend Keras runs on:
keras_safe_dist/backend/tensorflow/trainer.py or keras_safe_dist/backend/jax/trainer.py.
The JAX module (and jax) is imported only on the JAX backend.
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
