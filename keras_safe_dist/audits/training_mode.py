"""Training-mode findings: layers that should behave differently while training.

A custom train step that calls the model with `training=False` trains with
Dropout off and BatchNormalization statistics frozen, without any error. The
check takes a snapshot of the state such layers change only in training mode
(BatchNormalization moving statistics, the seed of dropout and noise layers)
before the first step, and compares after a few steps.
"""

import keras
import numpy as np

from keras_safe_dist import _compat
from keras_safe_dist.audits import _variables
from keras_safe_dist.core import on_jax
from keras_safe_dist.findings import Finding

__all__ = [
    "TrainingModeSnapshot",
    "frozen_batch_norm_findings",
    "training_dependent_layers",
]

_NOISE_LAYERS = (
    keras.layers.Dropout,
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
)


def frozen_batch_norm_findings(model):
    """`MODE003` for each non-trainable BatchNormalization of a trained model.

    A model with no trainable variables is not being trained: it gets no
    findings.

    Args:
        model: a `keras.Model`.

    Returns:
        A list of `MODE003` findings, one per BatchNormalization layer with
        `trainable=False`, each naming the layer's path.

    Example:

    ```python
    model.get_layer("batch_normalization").trainable = False
    print([f.code for f in frozen_batch_norm_findings(model)])  # ['MODE003']
    ```
    """
    if not model.trainable_variables:
        return []
    return [
        Finding.of(
            "MODE003",
            _name(layer),
            "BatchNormalization with trainable=False in a model being trained: "
            "it runs in inference mode, so its moving statistics stay frozen "
            "and it normalizes with them instead of the batch statistics.",
            f"Set `{layer.name}.trainable = True` unless freezing it is "
            "intended (fine-tuning), then silence MODE003.",
        )
        for layer in _batch_norms(model)
        if not layer.trainable
    ]


def training_dependent_layers(model):
    """The layers that behave differently in training, with the state they update.

    Args:
        model: a `keras.Model`.

    Returns:
        A list of `(layer, kind, state)`: kind `"batch norm"` and state its
        moving mean and variance for each trainable, built
        BatchNormalization; kind `"noise"` and state its seed generator's
        state for each Dropout, GaussianDropout, GaussianNoise and
        AlphaDropout with a non-zero rate (or stddev).

    Example:

    ```python
    for layer, kind, state in training_dependent_layers(model):
        print(layer.name, kind, [v.path for v in state])
    ```
    """
    layers = [
        (layer, "batch norm", _bn_state(layer))
        for layer in _batch_norms(model)
        if layer.trainable and layer.built
    ]
    for layer in _compat.flatten_layers(model):
        seed = getattr(layer, "seed_generator", None)
        if isinstance(layer, _NOISE_LAYERS) and _active(layer) and seed:
            layers.append((layer, "noise", [seed.state]))
    return layers


class TrainingModeSnapshot:
    """The training-mode state of a model, taken before training steps run.

    Records the moving statistics of each trainable, built
    BatchNormalization, the seed state of each active Dropout,
    GaussianDropout, GaussianNoise and AlphaDropout layer, and the mirrored
    non-trainable variables; `findings()` compares them after training steps.

    Args:
        model: a built `keras.Model`.

    Example:

    ```python
    snapshot = TrainingModeSnapshot(model)
    model.fit(x, y, epochs=1, steps_per_epoch=2)
    for finding in snapshot.findings():
        print(finding.code, finding.subject)
    ```
    """

    def __init__(self, model):
        # On JAX a variable is one global array: no replica copies to compare.
        self.replicas = 1 if on_jax() else model.distribute_strategy.num_replicas_in_sync
        self._watched = training_dependent_layers(model)
        excluded = {id(v) for _, _, state in self._watched for v in state}
        self._other = [
            v
            for v in model.non_trainable_variables
            if id(v) not in excluded
            and not on_jax()
            and _variables.describe(v, "", "").container == "mirrored"
        ]
        self._before = {
            id(v): _local_values(v)
            for _, _, state in self._watched
            for v in state
        }

    def findings(self):
        """`MODE001`, `MODE002` and `MODE004` findings after training steps.

        Returns:
            A list of findings: `MODE001` for a watched layer whose state did
            not change, `MODE004` for a BatchNormalization whose moving
            statistics differ across replicas, `MODE002` for another mirrored
            non-trainable variable whose copies differ.
        """
        findings = []
        for layer, kind, state in self._watched:
            after = {id(v): _local_values(v) for v in state}
            if all(
                _equal(self._before[id(v)], after[id(v)]) for v in state
            ):
                findings.append(_not_in_training_mode(layer, kind))
            elif kind == "batch norm" and not _all_replicas_equal(after):
                findings.append(_per_replica_statistics(layer, self.replicas))
        for variable in self._other:
            values = _variables.local_values(variable)
            if not _all_replicas_equal({0: values}):
                findings.append(_differs_across_replicas(variable, values))
        return findings


def _local_values(variable):
    if on_jax():
        return [np.array(variable.value)]
    return _variables.local_values(variable)


def _batch_norms(model):
    return [
        layer
        for layer in _compat.flatten_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def _name(layer):
    return getattr(layer, "path", None) or layer.name


def _bn_state(layer):
    return [layer.moving_mean, layer.moving_variance]


def _active(layer):
    return getattr(layer, "rate", getattr(layer, "stddev", 0)) > 0


def _equal(before, after):
    return all(np.array_equal(b, a) for b, a in zip(before, after))


def _all_replicas_equal(values_by_variable):
    return all(
        all(np.array_equal(values[0], other) for other in values[1:])
        for values in values_by_variable.values()
    )


def _not_in_training_mode(layer, kind):
    what = (
        "its moving mean and variance did not move"
        if kind == "batch norm"
        else "its random seed did not advance, so it applied no noise"
    )
    return Finding.of(
        "MODE001",
        _name(layer),
        f"{type(layer).__name__} ran in inference mode during training: "
        f"{what} over the first training steps.",
        "Call the model with `training=True` in the train step (and keep the "
        "updated non-trainable variables when using stateless_call).",
    )


def _per_replica_statistics(layer, replicas):
    return Finding.of(
        "MODE004",
        _name(layer),
        f"moving statistics differ across the {replicas} replicas: each "
        "replica updates its copy from its own share of the batch, and saving "
        "or evaluating outside the replicas reads the first replica's copy.",
        "Use BatchNormalization(synchronized=True) to compute the batch "
        "statistics over all replicas.",
    )


def _differs_across_replicas(variable, values):
    spread = max(float(np.max(np.abs(v - values[0]))) for v in values[1:])
    return Finding.of(
        "MODE002",
        variable.path,
        f"non-trainable variable whose copies differ across the "
        f"{len(values)} replicas (largest difference {spread:.3g}): each "
        "replica updated its own copy, so the model depends on which copy is "
        "read.",
        "Update it with values reduced across replicas, or create it with "
        "synchronization='on_read' if per-replica values are intended.",
    )
