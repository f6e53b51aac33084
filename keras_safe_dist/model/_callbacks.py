"""What `fit()` adds to its callbacks: the epoch boundary, and whether a callback asks for the update statistics."""

import keras

from keras_safe_dist.core import _warnings


class EpochBoundary(keras.callbacks.Callback):
    """Resets per-fit and per-epoch counters.

    With a known number of steps the last micro-batch of an epoch already
    applies its partial group in-graph; the rest (an epoch of unknown length,
    or one stopped early) is applied when Keras collects the epoch's logs,
    before validation (`SafeDistributedModel._end_epoch_steps`), or at the
    latest here. It overrides no batch hook, so Keras keeps dispatching
    batches asynchronously.
    """

    def on_train_begin(self, logs=None):
        self.model._update_engine.begin_fit()
        self.warned = False

    def on_epoch_begin(self, epoch, logs=None):
        self.model._update_engine.begin_epoch(self.params.get("steps"))

    def on_epoch_end(self, epoch, logs=None):
        model = self.model
        engine = model._update_engine
        if engine.end_epoch() and logs is not None and model._stats_logged:
            logs.update(
                {name: float(value) for name, value in engine.logs().items()}
            )
        # Loss-scale overflows are routine; a NaNOnsetDetector reports skips
        # itself. Otherwise one small read per epoch.
        if (
            self.warned
            or not model.skip_nonfinite
            or engine.loss_scale is not None
            or model._nan_link.probe is not None
            or engine.watch is not None  # JAX's detector
        ):
            return
        first = engine.first_skip()
        if first is not None:
            self.warned = True
            _warnings.warn(skip_message(epoch, *first, engine.steps))


def skip_message(epoch, update, samples, steps):
    if steps == 1:
        where = f"batch {update}"
    else:
        first = update * steps
        where = f"update {update} (micro-batches {first} to {first + steps - 1})"
    return (
        f"SafeDistributedModel skipped a non-finite update at epoch {epoch}, "
        f"{where}: the gradient or loss of its {samples} samples was NaN or "
        "infinite (or the gradient's global norm passed float32's range, about "
        "1.8e19), so they did not change the weights. Further skips in this "
        "fit() are counted without a warning (`skipped_updates` with "
        "`log_update_stats=True`). To find where the non-finite value began, "
        "add keras_safe_dist.callbacks.NaNOnsetDetector() to fit()'s callbacks."
    )


def requests_update_stats(callbacks):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return any(
        getattr(callback, "requests_update_stats", False) is True
        for callback in keras.tree.flatten(callbacks or [])
    )
