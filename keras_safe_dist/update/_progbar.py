"""Keras's progress bar, showing the loss and metrics without the update statistics.

Keras's `ProgbarLogger` prints every logged value in alphabetical order, so
the eleven update statistics (`statistics.LOG_NAMES`) put the loss sixth
on a line of 338 columns (the README quickstart). `SafeDistributedModel.fit()` gives this
progress bar to Keras when the statistics are logged: it shows what stock
Keras shows, while `History`, Keras's `TensorBoard` and every other callback
still receive the statistics.
"""

import keras

from keras_safe_dist.update.statistics import LOG_NAMES

__all__ = ["ProgbarWithoutStatistics", "for_fit"]

_HIDDEN = frozenset(LOG_NAMES)


def _shown(logs):
    """`logs` without the update statistics (a new dict: the others keep theirs)."""
    return {k: v for k, v in (logs or {}).items() if k not in _HIDDEN}


class ProgbarWithoutStatistics(keras.callbacks.ProgbarLogger):
    """`keras.callbacks.ProgbarLogger` that leaves the update statistics out of its line."""

    # Read by Keras's CallbackList: like the stock progress bar, which Keras
    # adds after it decides on asynchronous dispatch, its batch hook may run in
    # Keras's worker threads; it reads converted logs only.
    async_safe = True

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, _shown(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, _shown(logs))


def for_fit(callbacks, stats_requested):
    """The progress bar to add to `fit()`'s callbacks: `[ProgbarWithoutStatistics()]` or `[]`.

    `[]` when the statistics are not logged (the line is stock Keras's) or the
    user passed a `ProgbarLogger` of their own. With `verbose=0` it prints
    nothing, as Keras's own would.
    """
    if not stats_requested or any(
        isinstance(c, keras.callbacks.ProgbarLogger) for c in keras.tree.flatten(callbacks or [])
    ):
        return []
    return [ProgbarWithoutStatistics()]
