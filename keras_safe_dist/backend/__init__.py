"""Each backend's step behind one `SafeDistributedModel`, as Keras keeps one trainer per backend.

`model/__init__.py` picks the mixin of the backend Keras runs on, as Keras's own
`keras/src/models/model.py` does: `backend/tensorflow/trainer.py`'s
`TensorFlowTrainer` or `backend/jax/trainer.py`'s `JAXTrainer`. Each backend's
folder holds every part of its step (its update, its private APIs, its NaN
checks) and is imported on that backend only: TensorFlow's never on JAX, jax's
never on TensorFlow. The rule they share is in `update/`; `tests/test_layout.py`
checks the split. Importing this package imports neither.
"""
