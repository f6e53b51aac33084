"""Where a non-finite value came from: the kind, the replicas, the layer, the variables.

`NaNOnsetDetector` calls `locate` once per onset with a `SafeDistributedModel`:
the step's reduced flags say whether the weights were non-finite when it began
(the previous update broke them), which replicas fired and whose inputs were
non-finite; the rest (loss, a layer, or gradients) comes from replaying the
batch the firing replica captured. It
keeps `PlainSnapshots` for a plain `keras.Model` with `action="restore"`.
"""

import tensorflow as tf

from keras_safe_dist.backend.tensorflow import nan_replay as _nan_replay
from keras_safe_dist.scale_out import distributed

__all__ = ["PlainSnapshots", "locate"]


def locate(model, probe, report, step, logged, weights, restore=None):
    """Fills `kind`, `replicas`, `replica`, `layer`, `variables` and `notes`.

    Args:
        model: the `SafeDistributedModel`.
        probe: its `NaNProbe`.
        report: the report being built.
        step: the decoded flags of the onset step, or None for the weight
            check at the epoch end (after the last step's update and the
            flush of a partial accumulation group).
        logged: `{"loss": bool, "grad_norm": bool}`, whether the step's reduced
            loss and gradient norm are non-finite.
        weights: paths of the weights that are non-finite now.
        restore: with `action="restore"`, a callable that puts back the
            weights from before the step, or None.

    Returns:
        `{global replica id: (x, y, sample_weight)}`: the shares to save.
    """
    strategy = model.distribute_strategy
    if step is None or step.weights:
        # An update overflowed from a finite loss and finite gradients; the
        # batch that last ran is not the one that broke the weights.
        report.update(kind="weights", variables=list(weights), replica=None, replicas=[])
        return {}
    local = probe.captured_shares()
    offset = _replica_offset(strategy, len(local))
    shares = {index + offset: share for index, share in local.items()}
    if step.inputs:
        kind, replicas, layer = "inputs", list(step.input_replicas), None
    else:
        kind, replicas, layer = _replayed(model, report, step, logged, weights, shares, restore)
    report.update(kind=kind, replicas=replicas, layer=layer)
    report["replica"] = replicas[0] if replicas else None
    if replicas:
        shares = {r: share for r, share in shares.items() if r in replicas}
    if not shares:
        report["notes"].append(
            "The batch could not be captured (sparse, ragged or non-numeric inputs)."
            if probe.capture is None
            else "The shares that fired were not captured on this worker."
        )
    return shares


def _replayed(model, report, step, logged, weights, shares, restore):
    """`(kind, replicas, layer)` for a loss, a layer or gradients, by replaying the batch."""
    fallback = "loss" if logged["loss"] else "gradients"
    replicas = list(step.replicas)
    if isinstance(model.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
        report["notes"].append(
            "The batch is not replayed under MultiWorkerMirroredStrategy; replay the "
            "saved batch on one device to find the layer."
        )
        return fallback, replicas, None
    if weights:
        # skip_nonfinite=False: the step applied its non-finite update.
        if restore is None:
            report["notes"].append(
                "The step applied its non-finite update (skip_nonfinite=False), so the "
                "batch was not replayed; use action='restore' to replay it."
            )
            return fallback, replicas, None
        restore()
    # Without accumulation the step checks gradients only once reduced: replay
    # every share to name the replicas.
    targets = [r for r in sorted(shares) if r in replicas][:1] or sorted(shares)
    found = {r: _nan_replay.replay(model, *shares[r]) for r in targets}
    errors = {f.error for f in found.values() if f.error}
    report["notes"].extend(f"Replaying the batch failed ({error})." for error in sorted(errors))
    named = [r for r, f in found.items() if f.loss_finite is False or f.gradient_variables]
    if not named:
        if not errors:
            report["notes"].append(
                "Replaying the batch found every value finite; the step may not be "
                "deterministic."
            )
        return fallback, replicas, None
    first = found[named[0]]
    if first.loss_finite is False:
        return ("activations" if first.layer else "loss"), replicas or named, first.layer
    report["variables"] = list(first.gradient_variables)
    return "gradients", replicas or named, None


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
