"""Where a non-finite value came from on Keras's JAX backend: kind, layer, sample rows.

On TensorFlow the train step carries the detector's probes (`probe.NaNProbe`).
On JAX a `SafeDistributedModel`'s step keeps the detector's record
(`nan_watch.py`: which step went non-finite, the state held after it), and
once the detector reads an onset this module looks on the host: the weights
(non-finite after an update that overflowed), then the micro-batches of the
onset's accumulation group, which the JAX trainer keeps by reference
(`nan_watch.OnsetWatch.record_batch`). Each is replayed eagerly with
`model.stateless_call`, every layer's `call` wrapped to check its output, so
nothing the replay changes (BatchNormalization statistics, seeds, metrics)
reaches the model. On JAX a batch is one global array, so the report names
sample rows, never a replica. A plain `keras.Model` is checked from its
logged loss; `JAXSnapshots` keeps its copies for `action="restore"`.

Every process reads the same record at the same steps, and takes the same
decision.
"""

from typing import NamedTuple
from typing import Optional

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_safe_dist import _compat
from keras_safe_dist.backend.jax import _process_batch
from keras_safe_dist.backend.jax import nan_watch
from keras_safe_dist.nan.replay import wrapped_calls

__all__ = ["Found", "JAXSnapshots", "locate", "nonfinite_weights"]

# Rows replayed one by one to name those with a non-finite loss.
MAX_ROWS_REPLAYED = 256


class Found(NamedTuple):
    """What the replay of one micro-batch found.

    Attributes:
        kind: `inputs`, `activations`, `loss` or `gradients`, or None when
            every value was finite.
        layer: the first layer whose output is non-finite from finite
            inputs, or None.
        rows: the sample rows (0-based, in the micro-batch) holding the
            non-finite value, or `[]` when they cannot be told.
        variables: paths of the variables whose gradient is non-finite.
        error: the error the replay raised, or None.
    """

    kind: Optional[str]
    layer: Optional[str] = None
    rows: tuple = ()
    variables: tuple = ()
    error: Optional[str] = None


def nonfinite_weights(model):
    """Paths of `model`'s floating trainable weights holding a NaN or an infinity.

    One compiled computation over all of them and one host read, not one
    per weight (each eager operation is a launch, each read a wait).
    """
    weights = nan_watch.floating_weights(model)
    if not weights:
        return []
    finite = np.asarray(_all_finite_each([v.value for v in weights]))
    return [v.path for v, ok in zip(weights, finite) if not ok]


_all_finite_each = jax.jit(nan_watch.finite_each)


def locate(model, batches):
    """Replays `batches` (the onset group's micro-batches, oldest first) in order.

    Args:
        model: the `SafeDistributedModel`, its variables on the model
            (`jax_state_sync()` done) and holding the weights the group
            was computed with.
        batches: the `(x, y, sample_weight)` micro-batches.

    Returns:
        `(index, Found)` for the first micro-batch with a non-finite value,
        or `(None, Found(None))`.
    """
    errors = []
    if jax.process_count() > 1:
        # Every process replays the same global batches (each takes the same
        # decision on the same logs), whole on every device so that rows can
        # be read on the host.
        batches = [_process_batch.replicated(batch) for batch in batches]
    for index, batch in enumerate(batches):
        try:
            found = _replay(model, *keras.utils.unpack_x_y_sample_weight(batch))
        except Exception as error:  # noqa: BLE001 - a failed replay must not end training
            errors.append(f"{type(error).__name__}: {error}")
            continue
        if found.kind is not None:
            return index, found
    return None, Found(None, error="; ".join(errors) or None)


def fill_report(model, watch, report, logged, weights, previous, onset, *, action, steps_read):
    """Fills `kind`, `layer`, `rows`, `variables` and `notes` of a `NaNOnsetDetector` report.

    Args:
        model: the `SafeDistributedModel`, its state that of the onset.
        watch: its `nan_watch.OnsetWatch`, holding the onset's batches.
        report: the report being built.
        logged: `{"loss": bool, "grad_norm": bool}`, whether the onset
            step's loss and update are non-finite.
        weights: paths of the weights that are non-finite now.
        previous: whether the weights were already non-finite when the
            onset step began (the update before it broke them).
        onset: the record's `nan_watch.Onset`.
        action: the detector's `action`.
        steps_read: how many steps of this `fit()` the record had seen.

    Returns:
        `{None: (names, arrays)}` of the batch to save, or `{}`.
    """
    report["rows"] = []
    if previous or (weights and not logged["loss"] and not logged["grad_norm"]):
        report.update(kind="weights", variables=list(weights))
        return {}
    fallback = "loss" if logged["loss"] else "gradients"
    # Unless the replay below finds where it began, the report says only
    # what the record does.
    report["localized"] = False
    if weights:
        report["kind"] = fallback
        report["notes"].append(
            "The step applied its non-finite update (skip_nonfinite=False), so the "
            "batch was not replayed; use action='restore' to replay it."
        )
        return {}
    first, batches = watch.group(onset)
    if not batches:
        report["kind"] = fallback
        report["notes"].append("The onset's batches were no longer kept, so none was replayed.")
        return {}
    if action == "continue" and steps_read > onset.step + 1:
        report["notes"].append(
            "With action='continue' the batch was replayed with the weights of "
            f"{steps_read - onset.step - 1} steps later."
        )
    index, found = locate(model, batches)
    if found.kind is None:
        report["kind"] = fallback
        report["notes"].append(
            f"Replaying the batch failed ({found.error})." if found.error else
            "Replaying the batch found every value finite; the step may not be deterministic."
        )
        return {}
    report.update(kind=found.kind, layer=found.layer, rows=list(found.rows), localized=True)
    located = process_rows(batches[index], found.rows)
    if located is not None:
        # Several processes: the global batch is their local batches in
        # process order; name each row's process and its row there.
        report["process_rows"] = [list(pair) for pair in located]
    if found.variables:
        report["variables"] = list(found.variables)
    # The micro-batch of the group where the value entered.
    report["batch"] -= len(batches) - 1 - index
    return {None: named_arrays(batches[index])}


def process_rows(batch, rows):
    """`[(process, row of its local batch), ...]` for rows of a global batch; None in one process."""
    sizes = _process_batch.sizes_of(batch) if jax.process_count() > 1 else None
    return None if sizes is None else _process_batch.process_rows(sizes, rows)


def named_arrays(batch):
    """`(names, arrays)` of a micro-batch, as NumPy, for `nan_onset_batch.npz`."""
    if jax.process_count() > 1:
        batch = _process_batch.replicated(batch)
    names, arrays = [], []
    for name, part in zip(("x", "y", "sample_weight"), keras.utils.unpack_x_y_sample_weight(batch)):
        flat = [a for a in keras.tree.flatten(part) if a is not None]
        for i, array in enumerate(flat):
            names.append(name if len(flat) == 1 else f"{name}.{i}")
            arrays.append(np.asarray(array))
    return names, arrays


def _replay(model, x, y, sample_weight):
    rows = _nonfinite_rows((x, y, sample_weight))
    if rows:
        return Found("inputs", rows=tuple(rows))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    records = []
    kwargs = {"training": True} if _compat.call_has_training_arg(model) else {}
    with wrapped_calls(model, records, _recording):
        model.stateless_call(trainable, non_trainable, x, **kwargs)
    for name, inputs_ok, output_rows in records:
        if inputs_ok and output_rows is not None:
            return Found("activations", layer=name, rows=tuple(output_rows))
    loss, grads = _loss_and_gradients(model, trainable, non_trainable, x, y, sample_weight)
    if not bool(jnp.isfinite(loss)):
        return Found("loss", rows=tuple(_rows_with_nonfinite_loss(model, x, y, sample_weight)))
    variables = tuple(
        v.path
        for v, g in zip(model.trainable_variables, grads)
        if not bool(jnp.all(jnp.isfinite(g)))
    )
    if variables:
        return Found("gradients", variables=variables)
    return Found(None)


def _loss_and_gradients(model, trainable, non_trainable, x, y, sample_weight):
    optimizer = [v.value for v in model.optimizer.variables]
    with model._engine_out_of_metrics():
        metrics = [v.value for v in model.metrics_variables]
        (_, aux), grads = jax.value_and_grad(model._objective, has_aux=True)(
            trainable, non_trainable, metrics, optimizer, x, y, sample_weight
        )
    micro = aux[0]
    loss = micro.numerator if micro.denominator is None else micro.numerator / micro.denominator
    return loss, grads


def _rows_with_nonfinite_loss(model, x, y, sample_weight):
    """The rows whose loss alone is non-finite (the first `MAX_ROWS_REPLAYED`)."""
    count = len(keras.tree.flatten(x)[0])
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    rows = []
    for row in range(min(count, MAX_ROWS_REPLAYED)):
        part = keras.tree.map_structure(
            lambda a, r=row: None if a is None else np.asarray(a)[r : r + 1],
            (x, y, sample_weight),
        )
        loss, _ = _loss_and_gradients(model, trainable, non_trainable, *part)
        if not bool(jnp.isfinite(loss)):
            rows.append(row)
    return rows


def _recording(layer, call, records):
    def recorded_call(*args, **kwargs):
        outputs = call(*args, **kwargs)
        rows = _nonfinite_rows(outputs)
        records.append((layer.name, not _nonfinite_rows((args, kwargs)), rows or None))
        return outputs

    return recorded_call


def _nonfinite_rows(structure):
    """Sorted rows (index on the first axis) holding a non-finite floating value."""
    rows = set()
    for value in keras.tree.flatten(structure):
        if not hasattr(value, "dtype") or not hasattr(value, "shape") or not len(value.shape):
            continue
        if isinstance(value, keras.Variable):
            continue  # a layer's own weights are not its inputs
        array = np.asarray(value)
        if not np.issubdtype(array.dtype, np.floating):
            continue
        bad = ~np.isfinite(array.reshape(len(array), -1)).all(axis=1)
        rows.update(int(r) for r in np.flatnonzero(bad))
    return sorted(rows)


class JAXSnapshots:
    """Two rotating device copies of a plain model's weights and optimizer state (`action="restore"`).

    Keras's JAX trainer donates the state to each step, so a copy is taken
    (on the device, no host transfer) before each batch.
    """

    def __init__(self, model):
        self.model = model
        self.sources = list(model.trainable_variables) + list(model.optimizer.variables)
        self.slots = [None, None]
        self.taken = 0

    def take(self, step):
        self.model.jax_state_sync()  # Keras's JAX trainer keeps the state off the model mid-epoch
        self.slots[step % 2] = [jnp.copy(v.value) for v in self.sources]
        self.taken = step + 1

    def nonfinite_before(self, step):
        """Paths of the weights that were non-finite before batch `step`."""
        slot = self.slots[step % 2] or []
        return [
            variable.path
            for variable, value in zip(self.model.trainable_variables, slot)
            if jnp.issubdtype(value.dtype, jnp.floating) and not bool(jnp.all(jnp.isfinite(value)))
        ]

    def finite_before(self, step):
        """Whether the copy from before batch `step` holds finite weights only."""
        return not self.nonfinite_before(step)

    def restore(self, step):
        """Restores the latest finite copy from before batch `step` or `step - 1`.

        Returns:
            `"before this batch"`, `"before the previous batch"`, or None.
        """
        for age in (0, 1):
            if step - age < 0 or step - age >= self.taken or self.slots[(step - age) % 2] is None:
                continue
            if self.finite_before(step - age):
                for variable, value in zip(self.sources, self.slots[(step - age) % 2]):
                    variable.assign(value)
                return "before this batch" if age == 0 else "before the previous batch"
        return None
