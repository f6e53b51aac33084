"""A gradient-accumulation group pending when the weights are saved or loaded.

`train_on_batch()`, or a `fit()` interrupted or checkpointed mid-group, can
leave micro-batches accumulated but not yet applied. Stock Keras keeps its own
accumulation in the optimizer's variables, which a weights file holds; ours
are the model's own accumulators, which no file holds. So saving says what the
file leaves out, and loading weights drops the group: its gradients were
computed on the weights being replaced.
"""

from keras_safe_dist.core import _warnings

__all__ = ["drop_on_load", "warn_on_save"]

_WARNED = "_safe_dist_pending_save_warned"


def _engine(model):
    return model.__dict__.get("_update_engine")


def warn_on_save(model, where):
    """Warns, once per model, when a pending group is not in the file `where` writes."""
    engine = _engine(model)
    if engine is None or model.__dict__.get(_WARNED):
        return
    pending = engine.pending()
    if not pending:
        return
    model.__dict__[_WARNED] = True
    _warnings.warn(
        f"SafeDistributedModel.{where}(): {pending} micro-batch(es) of a gradient "
        f"accumulation group of {model.gradient_accumulation_steps} are pending (from "
        "train_on_batch(), or a fit() stopped or checkpointed mid-group), and the file "
        "cannot hold them: it has the weights before their update, and a model loaded "
        "from it starts a new group without them. This model keeps them. To save them, "
        "apply them first: the next fit() or compile() does. (Said once per model.)"
    )


def drop_on_load(model, where):
    """Drops a pending group before new weights are loaded, with a warning."""
    engine = _engine(model)
    if engine is None:
        return
    pending = engine.pending()
    if not pending:
        return
    engine.drop_pending()
    _warnings.warn(
        f"SafeDistributedModel.{where}() dropped {pending} micro-batch(es) of a pending "
        "gradient accumulation group: their gradients were computed on the weights it "
        "replaces. The next micro-batch starts a new group."
    )
