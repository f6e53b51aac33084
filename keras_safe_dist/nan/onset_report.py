"""The NaN onset report: its fields, its readable paragraph and its files."""

import io
import math
import os

import numpy as np

from keras_safe_dist.core import _files
from keras_safe_dist.findings import Finding
from keras_safe_dist.findings import markdown_row
from keras_safe_dist.report import writer
from keras_safe_dist.scale_out.distributed import is_chief

__all__ = [
    "KINDS",
    "PLAIN_FIXES",
    "PLAIN_MODEL_NOTE",
    "finish",
    "fix_for",
    "paragraph",
    "skips_finding",
    "write",
]

REPORT_FILE = "nan_onset.json"
BATCH_FILE = "nan_onset_batch.npz"
TAG = "nan_onset"

# kind: (what happened, a fix that can repair that kind). Clipping and a lower
# learning rate act on finite gradients only: they are offered where the
# gradients were finite, never for a NaN or inf gradient.
KINDS = {
    "inputs": (
        "a non-finite value in the inputs (x, y or sample_weight)",
        "Find the non-finite values in that batch (nan_onset_batch.npz when it was "
        "captured and log_dir is set) and fix the data pipeline that produced them.",
    ),
    "loss": (
        "a non-finite loss from finite inputs and finite layer outputs",
        "Guard the loss function against this batch (log of 0, division by 0): add an "
        "epsilon or clip its inputs, or pass from_logits=True to a built-in loss given "
        "logits.",
    ),
    "activations": (
        "a layer output that is non-finite although the layer's inputs are finite",
        "Guard that layer's computation (an epsilon under a log, sqrt or division, a "
        "stable formulation such as log-sum-exp); if its weights grew large over "
        "training, lower the learning rate; in float16, compute that layer in float32 "
        '(dtype="float32").',
    ),
    "gradients": (
        "non-finite gradients from a finite loss",
        "An op behind the listed variables has an infinite derivative at this batch's "
        "values (sqrt, pow with an exponent below 1 or a norm at 0; a log or division "
        "of 0 hidden by tf.where): make it safe where it is computed, e.g. sqrt(x + "
        "epsilon), or apply the where to the op's input too. Clipping and a lower "
        "learning rate cannot repair a NaN or inf gradient; in float16 without loss "
        "scaling, wrap the optimizer in keras.optimizers.LossScaleOptimizer.",
    ),
    "weights": (
        "weights that became non-finite in this batch's update",
        "Lower the learning rate or clip gradients with global_clipnorm: the update "
        "overflowed the weights.",
    ),
}

# A plain keras.Model's report is built from the logged loss and the weights
# only: its kinds do not say which computation failed, nor whether the
# gradients were finite (stock Keras applies non-finite ones).
PLAIN_FIXES = {
    "loss": (
        "To learn whether the inputs, a layer, the loss or the gradients turned "
        "non-finite, train with keras_safe_dist.SafeDistributedModel and this detector, "
        "which replays the onset's batch, and apply the fix its report gives for that "
        "kind."
    ),
    "weights": (
        "If the update's gradients were non-finite (a plain keras.Model applies them), "
        "use keras_safe_dist.SafeDistributedModel, which skips such updates, and this "
        "detector to find the op; if they were finite, lower the learning rate or clip "
        "gradients with global_clipnorm."
    ),
}

# The fixes of a SafeDistributedModel's onset whose batch was not replayed
# (skip_nonfinite=False applied the update), or whose replay did not
# reproduce it: what a replay would have told is not assumed either.
UNREPLAYED_FIXES = {
    "loss": (
        "Keep skip_nonfinite=True (the default) or use action='restore', so that the "
        "detector replays the onset's batch and names the inputs, layer, loss or "
        "gradients that turned non-finite, and apply the fix its report gives for that "
        "kind."
    ),
    "gradients": (
        "If the gradients grew over training, lower the learning rate or clip gradients "
        "with global_clipnorm; otherwise keep skip_nonfinite=True (the default) or use "
        "action='restore', so that the detector replays the onset's batch and names the "
        "op, and apply the fix its report gives."
    ),
}

# What an onset whose source was not located is (a plain keras.Model's, or
# one whose batch was not replayed): the kind it falls back to says which
# value was non-finite, not where it began.
UNLOCATED_WHAT = {
    "loss": "a non-finite loss (where it began was not located)",
    "gradients": "a non-finite update from a finite loss (where it began was not located)",
}

PLAIN_MODEL_NOTE = (
    "This is a plain keras.Model: only the logged loss is checked each step, and the "
    "weights when the loss turns non-finite and at epoch ends. The inputs, gradients, "
    "the layer, the replica and the batch itself are not localized; use "
    "keras_safe_dist.SafeDistributedModel for the full report."
)

_ACTIONS = {
    "stop": "Training stopped after this batch.",
    "restore": (
        "The weights and optimizer state were restored to the last finite values "
        "({restored}) and training stopped."
    ),
    "continue": (
        "Training continues with non-finite updates skipped, and stops after "
        "{limit} skipped updates in a row."
    ),
}


def what_for(report):
    """What the report says turned non-finite: no more than was located."""
    kind = report["kind"]
    if not report.get("localized", True) and kind in UNLOCATED_WHAT:
        return UNLOCATED_WHAT[kind]
    return KINDS[kind][0]


def finish(report, action, max_consecutive_skips):
    """Adds the finding, the action taken and the paragraph to `report`."""
    what, fix = what_for(report), fix_for(report)
    subject = report["layer"] or (report["variables"] or [report["kind"]])[0]
    message = f"{what} at epoch {report['epoch']}, batch {report['batch']}"
    report["finding"] = Finding.of("NAN001", subject, message, fix).to_dict()
    report["action_taken"] = _ACTIONS[action].format(
        restored=report.get("restored_to") or "none found", limit=max_consecutive_skips
    )
    report["summary"] = paragraph(report)
    return report


def fix_for(report):
    """The fix the report gives: one that can repair its kind.

    Args:
        report: the report, with its `kind`, whether it was `localized`
            (a plain `keras.Model`'s kinds come from the logged loss alone;
            a `SafeDistributedModel`'s from the replay, unless its batch was
            not replayed) and whether the model was a `plain_model`.

    Returns:
        A str of one or two sentences.
    """
    kind = report["kind"]
    if not report.get("localized", True):
        fixes = PLAIN_FIXES if report.get("plain_model", True) else UNREPLAYED_FIXES
        if kind in fixes:
            return fixes[kind]
    return KINDS[kind][1]


def paragraph(report):
    """One readable paragraph describing the onset."""
    what, fix = what_for(report), fix_for(report)
    where = f"epoch {report['epoch']}, batch {report['batch']}"
    if report["replicas"]:
        where += f", replica {', '.join(str(r) for r in report['replicas'])}"
    if report.get("rows"):
        shown = ", ".join(str(r) for r in report["rows"][:10])
        more = len(report["rows"]) - 10
        where += f", sample rows {shown}{f' and {more} more' if more > 0 else ''}"
    if report.get("process_rows"):
        pairs = report["process_rows"]
        shown = ", ".join(f"process {p} row {r}" for p, r in pairs[:10])
        more = len(pairs) - 10
        where += f" ({shown}{f' and {more} more' if more > 0 else ''} of its local batch)"
    text = [f"NaN onset at {where}: {what}."]
    if report.get("array_rows"):
        shown = ", ".join(str(r) for r in report["array_rows"][:10])
        more = len(report["array_rows"]) - 10
        plural = "s" if len(report["array_rows"]) > 1 else ""
        text.append(
            f"In the arrays passed to fit() (before shuffling): row{plural} {shown}"
            f"{f' and {more} more' if more > 0 else ''}."
        )
    if report["layer"]:
        text.append(f"First layer with a non-finite output from finite inputs: {report['layer']}.")
    if report["variables"]:
        shown = ", ".join(report["variables"][:5])
        more = len(report["variables"]) - 5
        text.append(f"Non-finite {report['kind']}: {shown}{f' and {more} more' if more > 0 else ''}.")
    losses = [_number(h["loss"]) for h in report["history"][-5:]]
    if losses:
        text.append(f"Logged loss over the last {len(losses)} steps: {', '.join(losses)}.")
    text.extend(report["notes"])
    text.append(report["action_taken"])
    text.append(f"Fix: {fix}")
    if report.get("files"):
        text.append("Written: " + ", ".join(report["files"].values()) + ".")
    return " ".join(text)


def markdown(report):
    """A markdown table of the report's fields followed by the paragraph."""
    rows = ["| field | value |", "| --- | --- |"]
    names = ("epoch", "batch", "kind", "layer", "variables", "replica", "action")
    if "rows" in report:  # JAX: sample rows instead of replicas
        names = ("epoch", "batch", "kind", "layer", "variables", "rows", "action")
    for name in names:
        value = report[name]
        value = [str(v) for v in value] if name == "rows" else value
        value = ", ".join(value) if isinstance(value, list) else value
        rows.append(markdown_row((name, "" if value is None else value)))
    return "**NaN onset**\n\n" + "\n".join(rows) + "\n\n" + report["summary"]


def write(report, log_dir, shares, step, strategy):
    """Writes the JSON report, the batch and the TensorBoard text; chief only."""
    if log_dir is None or not is_chief(strategy):
        return
    if shares:
        report["files"]["batch"] = os.path.join(log_dir, BATCH_FILE)
    report["files"]["report"] = os.path.join(log_dir, REPORT_FILE)
    report["summary"] = paragraph(report)
    with writer.writing("NaNOnsetDetector", log_dir):
        if shares:
            _files.makedirs(log_dir)
            # Zipped in memory: a remote file (GFile) cannot tell its position, which zip needs.
            archive = io.BytesIO()
            np.savez(archive, **_batch_arrays(shares))
            with _files.written_whole(report["files"]["batch"], "wb") as f:
                f.write(archive.getvalue())
    who = "NaNOnsetDetector"
    writer.write_json(log_dir, REPORT_FILE, report, strategy=strategy, who=who)
    writer.write_text(log_dir, TAG, markdown(report), step=step, strategy=strategy, who=who)


def skips_finding(count, epoch, batch):
    """The NAN002 finding for `count` skipped updates in a row."""
    return Finding.of(
        "NAN002",
        "skipped_updates",
        f"{count} consecutive updates were skipped as non-finite, the last at epoch "
        f"{epoch}, batch {batch}",
        "Fix the cause named in the NaN onset report; skipping cannot make progress.",
    )


def _batch_arrays(shares):
    """`{name: array}` of the captured shares; rows of several replicas concatenated.

    A share keyed None is the whole micro-batch (JAX): no `replica` column.
    """
    if None in shares:
        names, arrays = shares[None]
        return dict(zip(names, arrays))
    names = None
    columns = {}
    rows = []
    for replica, (names, arrays) in sorted(shares.items()):
        for name, array in zip(names, arrays):
            columns.setdefault(name, []).append(array)
        rows.append(np.full(len(arrays[0]), replica, np.int32))
    result = {}
    for name, parts in columns.items():
        try:
            result[name] = np.concatenate(parts)
        except ValueError:  # variable-length inputs: one array per replica
            for replica, part in zip(sorted(shares), parts):
                result[f"{name}.replica{replica}"] = part
    result["replica"] = np.concatenate(rows)
    return result


def _number(value):
    return "none" if value is None else ("nan" if math.isnan(value) else f"{value:.4g}")
