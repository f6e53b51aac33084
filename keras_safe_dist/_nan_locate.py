"""Where a non-finite value came from: the kind, the replicas, the layer, the variables.

`NaNOnsetDetector` calls `locate` once per onset with a `SafeDistributedModel`
(decoded step flags, captured shares, one replay per share it needs), and keeps
`PlainSnapshots` for a plain `keras.Model` with `action="restore"`.
"""

import tensorflow as tf

from keras_safe_dist import _nan_probe
from keras_safe_dist import _nan_replay
from keras_safe_dist import distributed

__all__ = ["PlainSnapshots", "locate"]


def locate(model, probe, report, step, norm_bad, weights):
    """Fills `kind`, `replicas`, `replica`, `layer`, `variables` and `notes`.

    Args:
        model: the `SafeDistributedModel`.
        probe: its `NaNProbe`.
        report: the report being built.
        step: the decoded flags of the onset step, or None (epoch-end check).
        norm_bad: whether the reduced gradient norm is non-finite.
        weights: paths of non-finite weights found on the host, or None.

    Returns:
        `{global replica id: (x, y, sample_weight)}`: the shares to save.
    """
    if weights:
        kind = "weights"
    elif step is None:
        kind = "loss"
    else:
        kind = next((k for k in _nan_probe.LOCAL_KINDS if step.kinds[k]), None)
        kind = kind or ("weights" if step.weights else "gradients" if norm_bad else "loss")
        report["replicas"] = list(step.replicas)
    report["replica"] = report["replicas"][0] if report["replicas"] else None
    strategy = model.distribute_strategy
    offset = _replica_offset(strategy, len(strategy.experimental_local_results(probe.captured)))
    shares = {
        index + offset: share
        for index, share in probe.captured_shares().items()
        # Replicas that did not fire at the onset captured a later batch (or,
        # for weights, every replica captured this one).
        if index + offset in report["replicas"] or not report["replicas"]
    }
    if shares and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        report["notes"].append(
            "The batch is not replayed under MultiWorkerMirroredStrategy; replay the "
            "saved batch on one device to find the layer."
        )
    elif shares:
        unnamed = kind == "gradients" and not report["replicas"]
        # Without accumulation the step checks only the reduced gradient:
        # every replica captured its share; replay each to name the replicas.
        targets = sorted(shares) if unnamed else [min(shares)]
        replays = {r: _nan_replay.replay(model, *shares[r]) for r in targets}
        if unnamed:
            named = [r for r, found in replays.items()
                     if found.gradient_variables or found.loss_finite is False]
            report["replicas"] = named
            report["replica"] = named[0] if named else None
            shares = {r: shares[r] for r in named} or shares
        found = replays[min(shares)]
        report["layer"] = found.layer
        if found.error:
            report["notes"].append(f"Replaying the batch failed ({found.error}).")
        if kind in ("loss", "gradients") and found.layer:
            kind = "activations"
        if kind == "gradients":
            report["variables"] = list(found.gradient_variables)
    elif probe.capture is None:
        report["notes"].append("The batch could not be captured (non-numeric inputs).")
    else:
        report["notes"].append("The batch was not captured on this worker.")
    if kind == "weights":
        report["variables"] = weights or _nan_replay.nonfinite_paths(model.trainable_weights)
    report["kind"] = kind
    return shares


class PlainSnapshots:
    """Two rotating eager copies of a plain model's weights and optimizer state.

    Slot `step % 2` holds the values from before batch `step` (counted since
    `fit()` began). Copies are eager assignments: no host sync.
    """

    def __init__(self, model):
        self.model = model
        self.sources = list(model.trainable_weights) + list(model.optimizer.variables)
        self.slots = [
            [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in self.sources]
            for _ in range(2)
        ]
        self.taken = 0

    def take(self, step):
        for snapshot, variable in zip(self.slots[step % 2], self.sources):
            snapshot.assign(variable)
        self.taken = step + 1

    def nonfinite_before(self, step):
        """Paths of the weights that were non-finite before batch `step`."""
        weights = self.model.trainable_weights
        slot = self.slots[step % 2]
        return [v.path for v, s in zip(weights, slot) if not _finite(s)]

    def restore(self, step):
        """Restores the latest finite copy from before batch `step` or `step - 1`.

        Returns:
            `"before this batch"`, `"before the previous batch"`, or None.
        """
        for age in (0, 1):
            if step - age < 0 or step - age >= self.taken:
                continue
            if not self.nonfinite_before(step - age):
                with self.model.distribute_strategy.scope():
                    for variable, value in zip(self.sources, self.slots[(step - age) % 2]):
                        variable.assign(value)
                return "before this batch" if age == 0 else "before the previous batch"
        return None


def _finite(value):
    return bool(tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(value))))


def _replica_offset(strategy, local_replicas):
    """Global id of this worker's first replica (0 in a single process)."""
    task_type, task_id, cluster = distributed._task(strategy)
    if task_type is None or task_type == "chief":
        return 0
    index = task_id + (1 if "chief" in cluster else 0)
    return index * local_replicas
