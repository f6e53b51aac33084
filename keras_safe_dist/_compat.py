"""The only module that touches private Keras APIs.

Every name used here is checked by `tests/test_compat.py`, so a Keras release
that renames or changes one fails that test loudly instead of breaking
training silently.
"""

import contextlib

from keras.src import backend as _keras_backend
from keras.src.losses import loss as _keras_loss
from keras.src.models.functional import Functional
from keras.src.trainers import trainer as _keras_trainer

# The class Keras instantiates for `Model(inputs=..., outputs=...)`.
Functional = Functional

# Loss reduction helpers, used to split a Keras loss into the numerator and
# denominator of its reduction.
reduce_weighted_values = _keras_loss.reduce_weighted_values
apply_mask = _keras_loss.apply_mask
squeeze_or_expand_to_same_rank = _keras_loss.squeeze_or_expand_to_same_rank


def compile_loss(model):
    """Returns the `CompileLoss` built by `model.compile()`, or None."""
    return getattr(model, "_compile_loss", None)


def loss_tracker(model):
    """Returns the `Mean` metric that Keras logs as `loss`."""
    return model._loss_tracker


def symbolic_build(model, data_batch):
    """Builds model, compiled loss and metrics from a batch of specs."""
    model._symbolic_build(data_batch=data_batch)


def compute_loss_is_overridden(model):
    """Whether `model` (or a parent below keras.Model) overrides compute_loss."""
    return type(model).compute_loss is not _keras_trainer.Trainer.compute_loss


@contextlib.contextmanager
def swapped_loss_functions(compiled_loss, wrap):
    """Temporarily replaces each flat loss function of a built `CompileLoss`.

    Args:
        compiled_loss: a built `CompileLoss`.
        wrap: called as `wrap(index, loss_fn, loss_weight)` for each flat loss;
            returns the callable used in its place.
    """
    original = compiled_loss._flat_losses
    compiled_loss._flat_losses = [
        entry._replace(loss=wrap(i, entry.loss, entry.loss_weights))
        for i, entry in enumerate(original)
    ]
    try:
        yield
    finally:
        compiled_loss._flat_losses = original


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Stops a TensorFlow-backend optimizer from all-reducing gradients.

    Inside this context `optimizer.apply()` trusts that its gradients were
    already summed across replicas, so the update costs no second all-reduce.
    """
    optimizer._all_reduce_sum_gradients = _identity
    try:
        yield
    finally:
        del optimizer._all_reduce_sum_gradients


def _identity(grads_and_vars):
    return list(grads_and_vars)


def keras_mask(tensor):
    """Returns the Keras mask attached to `tensor`, or None."""
    return _keras_backend.get_keras_mask(tensor)

