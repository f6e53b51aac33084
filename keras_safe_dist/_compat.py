"""The backend-neutral private Keras APIs keras_safe_dist relies on.

Private Keras APIs are used here and in each backend's own compatibility
module (`backend/tensorflow/_compat.py`, `backend/jax/_compat.py`, which
import that backend's library and so live in its folder), nowhere else
(`tests/test_layout.py` checks that no other module imports `keras.src`,
`tensorflow.python` or `jax._src`). Every name used is checked by
`tests/test_compat.py` (and, for JAX, `tests_jax/test_compat.py`), so a Keras
release that renames or changes one fails those tests loudly instead of
breaking training silently. This module imports neither TensorFlow nor jax.
"""

import contextlib
import functools

import keras
from keras.src import backend as _keras_backend
from keras.src.losses import loss as _keras_loss
from keras.src.models import cloning as _keras_cloning
from keras.src.models.functional import Functional
from keras.src.trainers import trainer as _keras_trainer

# The class Keras instantiates for `Model(inputs=..., outputs=...)`.
Functional = Functional

# Loss reduction helpers, used to split a Keras loss into the numerator and
# denominator of its reduction.
reduce_weighted_values = _keras_loss.reduce_weighted_values
apply_mask = _keras_loss.apply_mask
squeeze_or_expand_to_same_rank = _keras_loss.squeeze_or_expand_to_same_rank


def model_strategy(model):
    """The strategy whose scope `model` was created under, or None."""
    return model._distribute_strategy


def flatten_layers(model):
    """Every layer inside `model`, nested ones included, `model` excluded."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def activity_losses(model):
    """The losses that layers with an activity regularizer added in the last call.

    Keras adds a layer's activity penalty with `add_loss()`, so a layer's own
    losses are its activity penalties (and whatever its `call` added itself).
    """
    return [
        loss
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if getattr(layer, "activity_regularizer", None) is not None
        for loss in layer._get_own_losses()
    ]


def _outside_traces():
    """A context in which ops run eagerly, also while a step is being traced."""
    # The backend's library, imported here only: it is loaded already (Keras
    # imported it for its backend).
    if keras.backend.backend() == "jax":
        import jax

        return jax.ensure_compile_time_eval()
    import tensorflow as tf

    return tf.init_scope()


@functools.cache
def activity_penalty_per_sample():
    """Whether Keras divides a layer's activity penalty by the layer's batch size.

    keras 3.14 and later do, which makes the penalty a per-sample mean; earlier
    releases add it summed over the batch. Found once, by running a layer
    (outside any trace or scope the caller is in), not from version numbers.

    Raises:
        RuntimeError: the installed Keras follows neither convention.
    """
    with _outside_traces(), keras.StatelessScope(collect_losses=True):
        layer = keras.layers.Activation(
            "linear",
            activity_regularizer=keras.regularizers.L1(1.0),
            # Named, so that it takes no automatic name from the user's layers.
            name="keras_safe_dist_activity_probe",
        )
        layer(keras.ops.ones((4, 1)))
        penalty = float(layer.losses[0])
    if penalty not in (1.0, 4.0):
        raise RuntimeError(
            "keras_safe_dist does not know this Keras release's activity "
            "regularization: an L1(1.0) penalty on a batch of 4 ones came to "
            f"{penalty}, expected 1.0 (divided by the batch size, keras >= 3.14) "
            f"or 4.0 (summed, keras < 3.14). Keras {keras.__version__}."
        )
    return penalty == 1.0


def compile_loss(model):
    """Returns the `CompileLoss` built by `model.compile()`, or None."""
    return getattr(model, "_compile_loss", None)


def loss_tracker(model):
    """Returns the `Mean` metric that Keras logs as `loss`."""
    return model._loss_tracker


def compute_loss_is_overridden(model):
    """Whether `model` (or a parent below keras.Model) overrides compute_loss."""
    return type(model).compute_loss is not _keras_trainer.Trainer.compute_loss


def compute_loss(model, x, y, y_pred, sample_weight):
    """Calls `model.compute_loss` for training as Keras's own train step does.

    Keras's wrapper also supports overrides written before `compute_loss`
    took a `training` argument.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def call_has_training_arg(model):
    """Whether `model.call` takes a `training` argument."""
    return model._call_has_training_arg


def unscale_loss(value):
    """Undoes the 1 / replicas that Keras applies to losses under a strategy."""
    return _keras_loss.unscale_loss_for_distribution(value)


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
def per_output_loss_weight(compiled_loss, weight):
    """Makes a built `CompileLoss` weigh its per-output loss metrics' updates by `weight`.

    Keras updates each output's `<name>_loss` metric with the output's
    static batch size as the sample weight (`CompileLoss.__call__`): known
    on JAX, but unknown in TensorFlow's traced step, where each batch's
    value then counts 1 whatever its size, and under a `tf.distribute`
    strategy each replica's, also an empty share's 0.

    Args:
        compiled_loss: a built `CompileLoss`.
        weight: the sample weight of each update (a scalar tensor: the
            samples the loss was computed over).
    """
    metrics = [m for m in compiled_loss.metrics if m is not None]
    for metric in metrics:
        original = metric.update_state

        def update_state(values, sample_weight=None, _original=original):
            del sample_weight  # the static batch size
            return _original(values, sample_weight=weight)

        # Past the metric's attribute tracking; removed again below.
        object.__setattr__(metric, "update_state", update_state)
    try:
        yield
    finally:
        for metric in metrics:
            object.__delattr__(metric, "update_state")


def keras_mask(tensor):
    """Returns the Keras mask attached to `tensor`, or None."""
    return _keras_backend.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches a Keras mask to `tensor`."""
    _keras_backend.set_keras_mask(tensor, mask)


def flatten_metrics_in_order(model, logs):
    """`logs` as the list `train_on_batch(..., return_dict=False)` returns (one value: the value)."""
    return model._flatten_metrics_in_order(logs)


def set_initial_epoch(model, epoch):
    """Makes the next `fit()` of `model` start at `epoch` (None: at its `initial_epoch`).

    What Keras's `BackupAndRestore` sets to resume a run.
    """
    model._initial_epoch = epoch


def copy_options_on_clone(copy_options):
    """Makes `keras.models.clone_model` call `copy_options(model, clone)` for a functional model.

    Keras clones a functional model with `model.__class__(inputs, outputs,
    name=model.name)`, which passes none of a subclass's own constructor
    arguments; `copy_options` puts them on the clone. Installed once.
    """
    original = _keras_cloning._clone_functional_model
    if getattr(original, "_safe_dist_copy_options", None) is not None:
        return

    @functools.wraps(original)
    def clone_functional_model(model, *args, **kwargs):
        clone = original(model, *args, **kwargs)
        copy_options(model, clone)
        return clone

    clone_functional_model._safe_dist_copy_options = copy_options
    _keras_cloning._clone_functional_model = clone_functional_model


class EpochEndOverride:
    """Replaces the private `keras.Model` method every backend's `fit()` calls at an epoch's end.

    A class using this mixin implements `_update_log_names()`, the names its
    train step adds to the logs besides the metrics, and
    `_end_epoch_steps(logs)`, called when an epoch's steps are done, before
    Keras reads the epoch's logs, runs validation or calls `on_epoch_end`.
    """

    def _get_metrics_result_or_logs(self, logs):
        # Keras calls this once an epoch's steps are done, before validation
        # and the epoch-end callbacks.
        logs = self._end_epoch_steps(logs)
        # Keras replaces an epoch's last-step logs (each a mean of per-replica
        # results) with the metrics read across replicas, but only when the
        # keys match exactly. Keep that exact read with extra log names.
        names = self._update_log_names()
        if isinstance(logs, dict) and all(name in logs for name in names):
            metric_logs = {k: v for k, v in logs.items() if k not in names}
            result = dict(super()._get_metrics_result_or_logs(metric_logs))
            result.update({name: logs[name] for name in names})
            return result
        return super()._get_metrics_result_or_logs(logs)
