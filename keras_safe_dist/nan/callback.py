"""`NaNOnsetDetector`: the first step, tensor, layer and replica where training went non-finite."""

import collections
import math
import warnings

import keras

from keras_safe_dist.core import _validate
from keras_safe_dist.core import on_jax
from keras_safe_dist.nan import flags as _nan_flags
from keras_safe_dist.nan import onset_report
from keras_safe_dist.nan import rows as _nan_rows
from keras_safe_dist.nan._record_reads import RecordReads
from keras_safe_dist.nan.link import link_of
from keras_safe_dist.report import writer
from keras_safe_dist.scale_out import distributed
from keras_safe_dist.update import _rule

__all__ = ["NaNOnsetDetector"]

ACTIONS = ("stop", "restore", "continue")
_DEFAULT_CHECK_EVERY = 32
_DEFAULT_MAX_SKIPS = 10


def _jax_locate():
    # Each backend's replay, imported on that backend only: importing it
    # imports the backend's library.
    from keras_safe_dist.backend.jax import nan_locate

    return nan_locate


def _tf_locate():
    from keras_safe_dist.backend.tensorflow import nan_locate

    return nan_locate


def _tf_probe():
    from keras_safe_dist.backend.tensorflow import nan_probe

    return nan_probe


@keras.saving.register_keras_serializable(package="keras_safe_dist")
class NaNOnsetDetector(keras.callbacks.Callback):
    """Finds the first step at which training went non-finite, and why.

    With a `SafeDistributedModel`, the train step checks, on every replica, the
    weights when it begins (what the previous update produced), its share of
    the inputs (`x`, `y`, `sample_weight`) and its loss (with gradient
    accumulation, also its gradients), and keeps its share of the batch in a
    replica-local variable. The result travels with the step's logs as one
    scalar (no extra collective, no extra host round trip; Keras's TensorFlow
    trainer already turns the logs into Python numbers before any batch
    hook). Large finite inputs and weights are not reported: only NaNs and
    infinities are. The epoch's last update is checked at the epoch
    end, with one compiled function. On the first step that fires, the
    detector replays the firing replica's share once, eagerly, checking every
    layer's output (unless the weights were already non-finite: that is
    reported at the batch before), and reports:

    - `epoch`, `batch`: 0-based, as Keras counts batches in an epoch (with
      gradient accumulation, the micro-batch where the value entered);
    - `kind`: `inputs`, `loss`, `activations` (a layer made a non-finite output
      from finite inputs), `gradients` or `weights` (the update overflowed);
    - `layer`: the first layer, in forward order, whose output is non-finite
      from finite inputs on that batch, or None;
    - `variables`: paths of the non-finite gradients or weights;
    - `replica` / `replicas`: the replicas whose share fired (None / [] for
      weights, or with more than 16 replicas);
    - `history`: epoch, batch, logged loss and `grad_norm` of the last
      `history` steps.

    It writes `nan_onset.json`, the batch (`nan_onset_batch.npz`) and a
    markdown summary (`tf.summary.text`, tag `nan_onset`) into `log_dir` (the
    chief only), prints one paragraph, and keeps the report in `self.report`.

    On Keras's JAX backend the compiled step decides: it records the first
    step whose micro-batch loss or update is non-finite in a small array on
    the device (`keras_safe_dist.backend.jax.nan_watch`), and with
    `action="stop"` or `"restore"` every later step leaves the weights,
    optimizer state and non-trainable variables as they are. The detector
    reads no step's logs, so Keras keeps dispatching batch hooks
    asynchronously: every `check_every` steps (rounded up to whole
    executions with `steps_per_execution > 1`) it keeps a reference to the
    record the last step returned (in its logs, which Keras does not donate;
    the record is taken out of them before Keras sees them) and acts on the
    one kept at the check before, whose step has finished by then. That one
    is read at a batch end after the check that kept it, so the next check
    does not wait for the transfer: in Keras's callback thread, or where
    Keras runs the batch hooks on the thread that dispatches the steps (it
    does when another callback reads each step's logs), on that thread,
    after Keras has read that step's logs. The check reads it itself only
    where no batch end has yet. At each
    epoch's end it reads the record and checks the weights in one
    computation. No device operation of its own between steps. Training
    therefore stops at most `2 * check_every` steps after the onset with one
    step per execution, `2 * C + N - 1` with N steps per execution and C the
    interval rounded up to a multiple of N (at the epoch's end at the
    latest), with the state of the onset. It then replays the micro-batches
    of the onset's accumulation group eagerly with `model.stateless_call`
    (see `keras_safe_dist.backend.jax.nan_locate`) to name the kind, the
    first layer with a non-finite output from finite inputs and the sample
    `rows`; the batches of the last `2 * C + gradient_accumulation_steps`
    steps are kept for it until the `fit()` ends: in one process, host
    arrays (a reference to those of arrays and tf.data, the copy `fit()`
    makes of a generator's or a `PyDataset`'s batch; for other data, the
    batch Keras placed on an accelerator, or a host copy on a CPU), else the
    global batches Keras placed on the devices.
    A batch is one global array there, so `replica` is None and `replicas`
    empty.

    With a plain `keras.Model` only the logged loss is checked each step, and
    the weights when it turns non-finite and at epoch ends: the report has
    `kind` `loss` or `weights`, but no layer, replica, gradients or batch.

    Every replica and worker reads the same reduced logs, so all take the same
    decision. Put the detector before `ModelCheckpoint` or `BackupAndRestore`:
    epoch-end hooks run in list order, and the detector's finds (and, with
    `"restore"`, repairs) an overflow in the epoch's last update. Under a
    `LossScaleOptimizer` non-finite gradients are routine (the update is
    skipped and the scale halves) and are not reported.

    Args:
        log_dir: directory for the report files, or None to write nothing.
        action: `"stop"` ends training after the onset batch (with
            `skip_nonfinite`, its update was skipped). `"restore"` also puts
            back the weights and optimizer state from before that batch; it
            keeps two copies of both (from before each of the last two
            steps), refreshed every step. `"continue"` keeps
            training with non-finite updates skipped (SafeDistributedModel with
            `skip_nonfinite=True` only) and stops after
            `max_consecutive_skips` skipped updates in a row.
        history: number of steps of loss and grad norm kept for the report;
            integer >= 1.
        max_consecutive_skips: with `action="continue"`, how many skipped
            updates in a row end training; integer >= 1. Another value
            than 10 with another action has no effect, and warns.
        check_every: on JAX with a `SafeDistributedModel`, the steps between
            two reads of the step's record; integer >= 1. Smaller stops
            sooner after an onset and keeps fewer batches; each read is one
            small host transfer of the record kept `check_every` steps before,
            whose step has finished by then. Elsewhere every step's logs are
            checked: another value than 32 has no effect, and warns when
            training begins.

    Raises:
        ValueError: for an `action` other than `"stop"`, `"restore"` and
            `"continue"`, or a `history`, `max_consecutive_skips` or
            `check_every` that is not an integer >= 1; when training begins, for
            `action="continue"` without a SafeDistributedModel that skips
            non-finite updates, or for `steps_per_execution > 1` with a
            plain `keras.Model`, `run_eagerly=True` or `action="continue"`.
        TypeError: when `log_dir` is neither None, a str nor an
            `os.PathLike`.
        OSError: when training begins, for a `log_dir` the chief cannot
            create or write.

    Example:

    ```python
    detector = NaNOnsetDetector(log_dir="logs/run1", action="restore")
    model.fit(x, y, callbacks=[detector])
    if detector.report:
        print(detector.report["kind"], detector.report["layer"])
    ```
    """

    def __init__(
        self,
        log_dir=None,
        action="stop",
        history=50,
        max_consecutive_skips=_DEFAULT_MAX_SKIPS,
        check_every=_DEFAULT_CHECK_EVERY,
    ):
        if action not in ACTIONS:
            raise ValueError(
                f"`action` must be one of {', '.join(repr(a) for a in ACTIONS)}. "
                f"Received: action={action!r}"
            )
        history = _validate.integer_at_least("history", history)
        max_consecutive_skips = _validate.integer_at_least(
            "max_consecutive_skips", max_consecutive_skips
        )
        check_every = _validate.integer_at_least("check_every", check_every)
        if action != "continue" and max_consecutive_skips != _DEFAULT_MAX_SKIPS:
            warnings.warn(
                f"NaNOnsetDetector: max_consecutive_skips={max_consecutive_skips} has no "
                f"effect with action={action!r}; it bounds the skipped updates in a row "
                "with action='continue'.",
                stacklevel=2,
            )
        super().__init__()
        self.log_dir = _validate.optional_path("log_dir", log_dir)
        self.action = action
        self.history = history
        self.max_consecutive_skips = max_consecutive_skips
        self.check_every = check_every
        self.report = None
        self._in_step = False
        self._watch = None
        self._jax = False
        self._reads = None

    @property
    def requests_update_stats(self):
        """Read by SafeDistributedModel.fit(): the detector reads `grad_norm` and
        `skipped_updates` from each step's logs, unless the step keeps its record."""
        return not self._in_step

    @property
    def async_safe(self):
        """Read by Keras's callback list: with the record kept in the step, no batch hook reads logs."""
        return self._in_step

    def record_in_step(self, enabled):
        """Called by `SafeDistributedModel.fit()` before Keras builds its callback list.

        Args:
            enabled: whether the train step keeps this detector's record on
                the device (JAX), so that it reads no step's logs.
        """
        self._in_step = bool(enabled)

    def nan_probe_request(self):
        """What `SafeDistributedModel.fit` builds into its train step for this detector.

        Returns:
            A `ProbeRequest`: weight snapshots with `action="restore"`, a
            count of applied updates with `action="continue"`.
        """
        return _nan_flags.ProbeRequest(
            snapshot=self.action == "restore",
            count_updates=self.action == "continue",
            action=self.action,
            history=self.history,
            check_every=self.check_every,
            max_consecutive_skips=self.max_consecutive_skips,
        )

    def get_config(self):
        return {
            "log_dir": self.log_dir,
            "action": self.action,
            "history": self.history,
            "max_consecutive_skips": self.max_consecutive_skips,
            "check_every": self.check_every,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    # Per-run state.

    def on_train_begin(self, logs=None):
        model = self.model
        # What the model gives the detector (None for a plain keras.Model).
        self._link = link_of(model)
        self._probe = self._link.probe if self._link is not None else None
        self._full = self._probe is not None
        # Keras's JAX backend: the step's record on the device.
        self._watch = self._link.watch if self._link is not None and on_jax() else None
        self._jax = self._watch is not None
        counts_skips = self._full or self._jax
        if self.action == "continue" and not (counts_skips and model.skip_nonfinite):
            raise ValueError(
                "NaNOnsetDetector(action='continue') needs a SafeDistributedModel with "
                "skip_nonfinite=True, which skips non-finite updates. Received: "
                f"{type(model).__name__}"
                + (f" with skip_nonfinite={model.skip_nonfinite}" if counts_skips else "")
                + ". Use action='stop' or 'restore', or a SafeDistributedModel."
            )
        self._check_steps_per_execution(model)
        if not self._jax and self.check_every != _DEFAULT_CHECK_EVERY:
            warnings.warn(
                f"NaNOnsetDetector: check_every={self.check_every} has no effect here; it "
                "spaces the reads of the step's record on JAX with a SafeDistributedModel. "
                f"With {type(model).__name__} on {keras.backend.backend()} every step's "
                "logs are checked.",
                stacklevel=2,
            )
        if self.log_dir is not None and distributed.is_chief(distributed.strategy_of(model)):
            # Before any training: the report is written at the onset.
            _validate.writable_directory("NaNOnsetDetector", "log_dir", self.log_dir)
        self.report = None
        self._loss_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        self._replicas = 1 if on_jax() else model.distribute_strategy.num_replicas_in_sync
        self._recent = collections.deque(maxlen=self.history)
        self._step = 0
        self._epoch = 0
        self._last_batch = None
        self._previous = None
        self._consecutive = 0
        self._skipped_seen = 0
        self._applied_seen = 0
        self._plain_snapshots = None
        if self._jax:
            self._watch.reset(getattr(model, "steps_per_execution", 1))
        # JAX: the record kept at each check, read off the dispatching thread.
        self._reads = RecordReads(self._watch) if self._jax else None
        self._next_check = self.check_every
        self._epoch_starts = {}  # JAX: epoch -> its first step in this fit()
        self._steps_read = 0
        self._stopped_at_limit = False

    def on_train_end(self, logs=None):
        if self._jax:
            self._watch.release()  # the batches kept for a replay: none is left to make
        self._reads = None
        self._in_step = False

    def _check_steps_per_execution(self, model):
        steps = getattr(model, "steps_per_execution", 1)
        if steps == 1:
            return
        # A SafeDistributedModel's execution ends at the step that fired, and
        # says how many steps it ran; Keras's own returns only the last step's logs.
        if self._jax:
            return
        if not self._full:
            problem, fix = (
                f"a {type(model).__name__}, whose executions report only their last step",
                "Use a SafeDistributedModel, or steps_per_execution=1",
            )
        elif model.run_eagerly:
            problem, fix = "run_eagerly=True", "Use run_eagerly=False, or steps_per_execution=1"
        elif self.action == "continue":
            problem, fix = (
                "action='continue', which counts skipped updates step by step",
                "Use action='stop' or 'restore', or steps_per_execution=1",
            )
        else:
            return
        raise ValueError(
            "NaNOnsetDetector names the batch of the onset; with "
            f"steps_per_execution={steps} it needs each step's logs, which it "
            f"cannot get with {problem}. {fix}."
        )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._applied_seen = 0
        self._epoch_starts[epoch] = self._steps_read
        self._next_check = self.check_every

    def on_train_batch_begin(self, batch, logs=None):
        if self._jax:
            # No log is read: every `check_every` steps, the record kept at
            # the check before (its step has finished), and a new one kept.
            if batch >= self._next_check:
                self._next_check = batch + self.check_every
                self._check_record()
            return
        self._execution_begin = batch
        if self.action == "restore" and not self._full:
            # Plain keras.Model, or JAX: two rotating copies, taken eagerly (no host transfer).
            if self._plain_snapshots is None:
                self._plain_snapshots = (
                    _jax_locate().JAXSnapshots(self.model)
                    if on_jax()
                    else _tf_locate().PlainSnapshots(self.model)
                )
            self._plain_snapshots.take(self._step)

    # This hook reads the step's logs. Keras's TensorFlow trainer never
    # dispatches batch hooks asynchronously (its backend is not thread safe)
    # and converts the logs to Python numbers before calling any of them, so
    # overriding it adds no host sync. On JAX a SafeDistributedModel's step
    # keeps the record instead, and the detector declares itself async-safe
    # (this hook returns at once); with a plain keras.Model on JAX it does
    # turn Keras's asynchronous dispatch off: reading each step's loss is how
    # the detector names the onset batch there.
    def on_train_batch_end(self, batch, logs=None):
        if self._in_step:
            # JAX: the step keeps the record. Keras calls this hook in its
            # callback threads, after the step's logs have reached the host:
            # the record kept at the last check is read here, once, off the
            # thread that dispatches the steps, for the next check to act on.
            reads = self._reads  # None once the fit() has ended
            if reads is not None:
                reads.read_kept()
            return
        logs = logs or {}
        flags = {name: logs.pop(name) for name in _nan_flags.LOG_NAMES if name in logs}
        loss, norm = logs.get("loss"), logs.get("grad_norm")
        # With several steps per execution the logs are its last step's, and
        # say how many steps it ran (it ends at a step that fired).
        steps = 1
        if _nan_flags.LOG_NAMES[2] in flags:
            steps = int(round(flags.pop(_nan_flags.LOG_NAMES[2])))
            batch = self._execution_begin + steps - 1
            if steps > 1:
                self._last_batch = (self._epoch, batch - 1)
        self._recent.append({"epoch": self._epoch, "batch": batch, "loss": loss, "grad_norm": norm})
        self._previous, self._last_batch = self._last_batch, (self._epoch, batch)
        self._step += steps
        if self.report is None:
            logged = {
                "loss": loss is not None and not math.isfinite(loss),
                # Under loss scaling non-finite gradients are routine.
                "grad_norm": norm is not None and not math.isfinite(norm) and not self._loss_scaled,
            }
            if flags.get("nonfinite_replicas") or any(logged.values()):
                step = _nan_flags.decode(flags, self._replicas) if flags else None
                # Weights non-finite when this step began: the previous update broke them.
                self._onset(step, logged, previous=step is not None and step.weights > 0)
        if self.action == "continue" and "applied_updates" in flags:
            applied = int(round(flags["applied_updates"]))
            self._count_skips(logs.get("skipped_updates"), applied > self._applied_seen)
            self._applied_seen = applied

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        for name in _nan_flags.LOG_NAMES:
            logs.pop(name, None)
        if self._jax:
            # Keras put the state back on the model at the epoch's end: one
            # computation and one read for the record and the weights.
            self._reads.drop()
            onset, weights = self._watch.read_with_weights(self.model)
            self._act_on_record(onset)
            if self.report is None and self._last_batch is not None:
                if weights:
                    self._at_step(self._steps_read - 1)
                    self._onset(None, {"loss": False, "grad_norm": False}, weights=weights)
            return
        if self.action == "continue" and self._full and not self.model.stop_training:
            # A partial accumulation group may have been applied or skipped
            # after the last step (SafeDistributedModel's epoch-end flush).
            applied = self._updates_in_epoch()
            self._count_skips(logs.get("skipped_updates"), applied > self._applied_seen)
        # A step checks the weights the update before it produced: the epoch's
        # last update (and the flush of a partial accumulation group) is
        # checked here, once, before the next epoch or the end of training.
        if self.report is None and self._last_batch is not None:
            weights = self._nonfinite_weights()
            if weights:
                self._onset(None, {"loss": False, "grad_norm": False}, weights=weights)

    # Onset.

    def _onset(self, step, logged, previous=False, weights=None, onset=None):
        """Builds, writes and acts on the report.

        Args:
            step: the last step's decoded flags, or None (epoch-end check).
            logged: whether its logged loss and grad norm are non-finite.
            previous: the weights were non-finite when the last step began:
                report the step before it, and restore from before that one.
            weights: paths of the non-finite weights, when already checked.
            onset: JAX: the step's record (`nan_watch.Onset`).
        """
        model = self.model
        history = list(self._recent)
        (epoch, batch), index = self._last_batch, self._step - 1
        if previous and self._previous is not None:
            (epoch, batch), index, history = self._previous, index - 1, history[:-1]
        report = {
            "epoch": epoch,
            "batch": batch,
            "step": index,
            "kind": None,
            "layer": None,
            "variables": [],
            "replica": None,
            "replicas": [],
            "history": history,
            "action": self.action,
            "model": type(model).__name__,
            # A SafeDistributedModel's report is located unless the replay says otherwise.
            "localized": self._full or self._jax,
            "plain_model": not (self._full or self._jax),
            "notes": [],
            "files": {},
        }
        if weights is None:
            weights = self._nonfinite_weights()
        shares = {}
        if self._jax and onset is not None:
            shares = _jax_locate().fill_report(
                model, self._watch, report, logged, weights, previous, onset,
                action=self.action, steps_read=self._steps_read,
            )
        elif self._jax:
            report["kind"] = "weights"
            report["variables"] = list(weights)
        elif self._full:
            restore = self._probe.restore if self.action == "restore" else None
            shares = _tf_locate().locate(model, self._probe, report, step, logged, weights, restore)
        else:
            self._onset_plain(report, weights, from_logs=any(logged.values()))
        if previous and self._previous is None:
            report["notes"].append("The weights were non-finite before training began.")
        if self.action == "restore":
            # JAX: the step held the state from an onset it recorded; weights
            # found non-finite at an epoch's end were not held.
            self._restore(report, previous or (self._jax and onset is None))
        if self.action != "continue":
            model.stop_training = True
        named = shares if self._jax else {r: self._probe.named(share) for r, share in shares.items()}
        if report["kind"] == "inputs" and "process_rows" not in report:
            self._find_in_fit_arrays(report, named)
        onset_report.finish(report, self.action, self.max_consecutive_skips)
        try:
            onset_report.write(
                report, self.log_dir, named, report["step"], distributed.strategy_of(model)
            )
        except OSError as error:
            # The report is what the user needs: keep it, print it, and say
            # what could not be written.
            report["files"] = {}
            report["summary"] = onset_report.paragraph(report)
            warnings.warn(
                f"NaNOnsetDetector could not write its report to log_dir={self.log_dir!r}: "
                f"{error}. The report is printed below and kept in `detector.report`.",
                stacklevel=2,
            )
        self.report = report
        if distributed.is_chief(distributed.strategy_of(model)):
            print(report["summary"])

    def _find_in_fit_arrays(self, report, named):
        """Names the rows of the arrays given to `fit()` that hold the onset batch's bad samples."""
        arrays = self._link.fit_arrays if self._link is not None else None
        if arrays is None:
            report["notes"].append(_nan_rows.DATA_NOTE)
            return
        if named:
            report["array_rows"] = _nan_rows.user_rows(arrays, named)

    def _onset_plain(self, report, weights, from_logs):
        report["notes"].append(onset_report.PLAIN_MODEL_NOTE)
        report["kind"] = "loss" if from_logs else "weights"
        report["variables"] = weights
        if self._plain_snapshots is not None and from_logs and self._previous is not None:
            broken = self._plain_snapshots.nonfinite_before(self._step - 1)
            if broken:
                # The weights were already non-finite when this batch began: the
                # previous batch's update made them so.
                report.update(kind="weights", variables=broken)
                report["epoch"], report["batch"] = self._previous

    # JAX: the step's record.

    def _check_record(self):
        onset = self._reads.take()
        if onset is not None and self._act_on_record(onset):
            return
        if self.report is None or (self.action == "continue" and not self._stopped_at_limit):
            self._reads.keep()

    def _act_on_record(self, onset):
        """Reports an onset the record holds, and stops where it says; returns whether it acted."""
        model = self._model  # no state sync unless there is something to report
        self._steps_read = onset.steps
        acted = False
        if self.report is None and onset.step is not None:
            model.jax_state_sync()  # the state the record held, on the model
            self._at_step(onset.step)
            logged = {"loss": onset.loss, "grad_norm": onset.update}
            weights = self._nonfinite_weights()
            # Weights non-finite at the onset step's start (with the
            # update skipped or held, they are still those): the update
            # before it made them so.
            previous = bool(weights) and (model.skip_nonfinite or self.action == "restore")
            self._onset(None, logged, previous=previous, weights=weights, onset=onset)
            acted = True
        if onset.limit_step is not None and not self._stopped_at_limit:
            self._stopped_at_limit = True
            model.stop_training = True
            epoch, batch = self._batch_of(onset.limit_step)
            self._report_skips(self.max_consecutive_skips, epoch, batch)
            acted = True
        if onset.steps > self._epoch_starts.get(self._epoch, 0) and self.report is None:
            # The last step, for the epoch-end check of the weights.
            self._last_batch = self._batch_of(onset.steps - 1)
        return acted

    def _batch_of(self, step):
        """`(epoch, batch)` of a step of this fit() (JAX's record counts steps)."""
        epoch = max(e for e, first in self._epoch_starts.items() if first <= step)
        return epoch, step - self._epoch_starts[epoch]

    def _at_step(self, step):
        """Sets the position the report reads to the record's step, with its history."""
        self._step = step + 1
        self._last_batch = self._batch_of(step)
        self._previous = self._batch_of(step - 1) if step > 0 else None
        self._recent.clear()
        for index, loss, norm in self._watch.history_rows(step, self.history):
            epoch, batch = self._batch_of(index)
            self._recent.append(
                {"epoch": epoch, "batch": batch, "loss": loss, "grad_norm": norm}
            )

    def _restore(self, report, previous):
        if self._jax:
            # The step held the onset's update and every later one: the
            # weights are those from before the onset batch. Otherwise the
            # copy from the start of the step before is put back.
            if previous and not self._watch.restore_previous(self.model):
                report["restored_to"] = None
                report["notes"].append("No finite copy of the weights was available to restore.")
                return
            report["restored_to"] = "before this batch"
            return
        if self._full:
            if previous and self._previous is None:
                report["restored_to"] = None
                report["notes"].append("No finite copy of the weights was available to restore.")
                return
            self._probe.restore(previous=previous)
            report["restored_to"] = "before this batch"
            return
        restored = None
        if self._plain_snapshots is not None:
            restored = self._plain_snapshots.restore(self._step - 1)
        if restored is None:
            report["notes"].append("No finite copy of the weights was available to restore.")
        report["restored_to"] = restored

    # Helpers.

    def _count_skips(self, skipped, applied):
        if skipped is None:
            return
        new = int(round(skipped)) - self._skipped_seen
        self._skipped_seen = int(round(skipped))
        if new > 0:
            self._consecutive += new
        elif applied:
            self._consecutive = 0
        if self._consecutive >= self.max_consecutive_skips and not self.model.stop_training:
            self.model.stop_training = True
            epoch, batch = self._last_batch
            self._report_skips(self._consecutive, epoch, batch)

    def _report_skips(self, count, epoch, batch):
        finding = onset_report.skips_finding(count, epoch, batch)
        print(f"NaNOnsetDetector: {finding.message}; training stopped. {finding.fix}")
        if self.report is not None:
            self.report["skips"] = finding.to_dict()
            if self.log_dir is not None:
                writer.write_json(
                    self.log_dir,
                    onset_report.REPORT_FILE,
                    self.report,
                    strategy=distributed.strategy_of(self.model),
                    who="NaNOnsetDetector",
                )

    def _nonfinite_weights(self):
        if on_jax():
            return _jax_locate().nonfinite_weights(self.model)
        return _tf_probe().WeightCheck.of(self.model)()

    def _updates_in_epoch(self):
        stats = self._link.statistics.numpy()
        return int(stats[_rule.index("updates_in_epoch")])


