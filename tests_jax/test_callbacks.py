"""The callbacks, the audits and `keras-safe-dist report` on Keras's JAX backend."""

import glob
import json
import os
import warnings

import keras
import numpy as np
import pytest
from keras import ops
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

import keras_safe_dist
from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist import cli
from keras_safe_dist.nan import onset_report
from keras_safe_dist.report import read_log_dir
from keras_safe_dist.update.statistics import LOG_NAMES

from conftest import regression_data


class Root(keras.layers.Layer):
    """sqrt(x): NaN for a negative input."""

    def call(self, x):
        return ops.sqrt(x)


class AbsRoot(keras.layers.Layer):
    """sqrt(|x|): finite everywhere, with an infinite derivative at 0."""

    def call(self, x):
        return ops.sqrt(ops.abs(x))


def mlp(steps=1, skip_nonfinite=True, learning_rate=0.01, root=None):
    """`root="activation"`: sqrt of the inputs; `"gradient"`: sqrt(|.|) after a Dense."""
    inputs = keras.Input((4,))
    x = inputs
    if root == "activation":
        x = Root(name="root")(x)
    elif root == "gradient":
        x = AbsRoot(name="root")(keras.layers.Dense(4, use_bias=False, name="pre")(x))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(1, name="out")(x)
    model = SafeDistributedModel(
        inputs,
        outputs,
        gradient_accumulation_steps=steps,
        global_clipnorm=1.0,
        skip_nonfinite=skip_nonfinite,
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    return model


def fit(model, x, y, callbacks_, batch_size=8, epochs=2, **kwargs):
    return model.fit(
        x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=callbacks_,
        shuffle=False, **kwargs,
    )


def scalars(run_dir, prefix):
    accumulator = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    values = {}
    for tag in accumulator.Tags()["tensors"]:
        if tag.startswith(prefix):
            values[tag[len(prefix):]] = [
                float(tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)
            ]
    return values


# Dashboard


def test_dashboard_writes_the_history_values_to_tensorboard(tmp_path, devices):
    x, y, _ = regression_data(44)  # 44 = 5 batches of 8 and one of 4
    model = mlp(steps=2)
    history = fit(model, x, y, [callbacks.Dashboard(str(tmp_path))], epochs=3)
    written = scalars(str(tmp_path / "safe_distributed"), "safe_distributed/")
    per_epoch = {k: v for k, v in written.items() if not k.startswith("update/")}
    assert sorted(per_epoch) == sorted(LOG_NAMES)
    for name in LOG_NAMES:
        np.testing.assert_allclose(written[name], history.history[name], rtol=1e-6)
    # One point per update (update_freq=1): 3 updates per epoch.
    assert written["update/samples_per_update"] == [16.0, 16.0, 12.0] * 3
    assert written["update/skipped_updates"] == [0.0] * 9
    # 6 micro-batches, groups of 2: 3 updates of 16, 16 and 12 samples per epoch.
    assert history.history["samples_per_update_min"] == [12.0] * 3
    assert history.history["samples_per_update_mean"] == pytest.approx([44 / 3] * 3)
    assert history.history["skipped_updates"] == [0.0] * 3


@pytest.mark.parametrize("data", ["arrays", "generator with steps_per_epoch"])
def test_dashboard_charts_an_epochs_partial_last_group_with_its_own_values(tmp_path, devices, data):
    # JAX applies the partial group when the epoch ends: its point copied the
    # update before it (grad_norm 3.65 and 24 samples for 1.80 and 12).
    x, y, _ = regression_data(60)  # 8 micro-batches, groups of 3: updates of 24, 24, 12
    model = mlp(steps=3)
    if data == "arrays":
        history = fit(model, x, y, [callbacks.Dashboard(str(tmp_path))], epochs=1)
    else:
        def batches():
            for start in range(0, 60, 8):
                yield x[start:start + 8], y[start:start + 8]

        history = model.fit(
            batches(), steps_per_epoch=8, epochs=1, verbose=0,
            callbacks=[callbacks.Dashboard(str(tmp_path))],
        )
    written = scalars(str(tmp_path / "safe_distributed"), "safe_distributed/")
    assert written["update/samples_per_update"] == [24.0, 24.0, 12.0]
    assert written["update/grad_norm"][-1] == pytest.approx(history.history["grad_norm"][0], rel=1e-6)
    assert written["update/grad_norm"][-1] != pytest.approx(written["update/grad_norm"][-2], rel=1e-3)


# NaNOnsetDetector


def test_nan_detector_names_the_layer_batch_and_row_of_a_non_finite_activation(
    tmp_path, devices
):
    x, y, _ = regression_data(40)
    x[:, :] = np.abs(x) + 0.5
    x[21, 0] = -4.0  # batch 2 (rows 16-23), row 5 of it: sqrt of a negative
    detector = callbacks.NaNOnsetDetector(log_dir=str(tmp_path))
    model = mlp(steps=2, root="activation")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the detector reports; no skip warning besides
        fit(model, x, y, [detector])
    report = detector.report
    assert (report["epoch"], report["batch"], report["kind"]) == (0, 2, "activations")
    assert report["layer"] == "root"
    assert report["rows"] == [5]
    assert (report["replica"], report["replicas"]) == (None, [])
    assert "sample rows 5" in report["summary"]
    assert model.stop_training
    assert not keras_safe_dist.backend.jax.nan_locate.nonfinite_weights(model)
    with open(tmp_path / "nan_onset.json") as f:
        assert json.load(f)["layer"] == "root"
    batch = np.load(tmp_path / "nan_onset_batch.npz")
    assert sorted(batch.files) == ["x", "y"]
    np.testing.assert_array_equal(batch["x"], x[16:24])


def test_nan_detector_names_the_rows_of_non_finite_inputs(devices):
    x, y, _ = regression_data(40)
    x[9, 2] = np.nan  # batch 1, row 1
    x[14, 0] = np.inf  # batch 1, row 6
    detector = callbacks.NaNOnsetDetector()
    fit(mlp(), x, y, [detector])
    report = detector.report
    assert (report["epoch"], report["batch"], report["kind"], report["rows"]) == (
        0, 1, "inputs", [1, 6]
    )


def test_a_nan_in_shuffled_arrays_is_named_by_its_row_in_the_arrays(devices):
    x, y, _ = regression_data(64)
    x[57, 1] = np.nan
    detector = callbacks.NaNOnsetDetector()
    mlp().fit(x, y, batch_size=8, epochs=1, shuffle=True, verbose=0, callbacks=[detector])
    report = detector.report
    assert report["kind"] == "inputs" and report["array_rows"] == [57]
    assert "In the arrays passed to fit() (before shuffling): row 57." in report["summary"]


def log_loss(y_true, y_pred):
    # NaN for a negative target, from finite outputs.
    return ops.mean(ops.square(y_pred - y_true) + 0.0 * ops.log(y_true), axis=-1)


def test_nan_detector_names_the_rows_of_a_non_finite_loss(devices):
    x, y, _ = regression_data(40)
    y[:] = np.abs(y) + 0.5
    y[13] = -1.0  # batch 1, row 5
    model = mlp()
    model.compile(optimizer="sgd", loss=log_loss)
    detector = callbacks.NaNOnsetDetector()
    fit(model, x, y, [detector])
    report = detector.report
    assert (report["batch"], report["kind"], report["layer"], report["rows"]) == (
        1, "loss", None, [5]
    )


def test_nan_detector_names_the_variables_of_non_finite_gradients(devices):
    x, y, _ = regression_data(40)
    x[:, :] = np.abs(x) + 0.5
    x[27] = 0.0  # batch 3: sqrt at 0 is finite, its derivative is not
    detector = callbacks.NaNOnsetDetector()
    model = mlp(root="gradient")
    fit(model, x, y, [detector])
    report = detector.report
    assert (report["epoch"], report["batch"], report["kind"]) == (0, 3, "gradients")
    assert report["variables"] == ["pre/kernel"]
    assert report["layer"] is None
    assert int(model._update_engine.stats.value[4]) == 1  # skipped, weights kept finite


def test_nan_detector_blames_the_update_that_overflowed_the_weights(devices):
    x, y, _ = regression_data(40)
    detector = callbacks.NaNOnsetDetector()
    model = mlp(learning_rate=1e37)
    model.global_clipnorm = None
    fit(model, x * 1e3, y * 1e3, [detector])
    report = detector.report
    assert report["kind"] == "weights"
    assert report["batch"] == 0  # the first update broke them; batch 1's loss showed it
    assert "hidden/kernel" in report["variables"]


def test_nan_detector_restore_replays_an_applied_non_finite_update(devices):
    x, y, _ = regression_data(40)
    x[:, :] = np.abs(x) + 0.5
    x[27] = 0.0
    detector = callbacks.NaNOnsetDetector(action="restore")
    model = mlp(root="gradient", skip_nonfinite=False)
    fit(model, x, y, [detector])
    report = detector.report
    assert (report["batch"], report["kind"]) == (3, "gradients")
    assert report["restored_to"] == "before this batch"
    assert not keras_safe_dist.backend.jax.nan_locate.nonfinite_weights(model)


def test_nan_detector_continue_stops_after_consecutive_skips(devices, capsys):
    x, y, _ = regression_data(40)
    x[:, :] = np.abs(x) + 0.5
    x[8::8] = 0.0  # batches 1 to 4 all skip
    detector = callbacks.NaNOnsetDetector(action="continue", max_consecutive_skips=3)
    model = mlp(root="gradient")
    history = fit(model, x, y, [detector])
    assert detector.report["batch"] == 1
    assert detector.report["skips"]["code"] == "NAN002"
    assert len(history.history["loss"]) == 1  # stopped in epoch 0
    assert "3 consecutive updates were skipped" in capsys.readouterr().out


def test_nan_detector_stops_within_two_checks_with_the_weights_of_the_onset(devices):
    # The step records the onset and holds the state after it; the host
    # reads the record every check_every steps, one check behind.
    x, y, _ = regression_data(200)  # 25 batches of 8
    x[58, 1] = np.nan  # batch 7
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs))
    model = SafeDistributedModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    stock = keras.Model(inputs, outputs)  # the same layers: one device, stock Keras
    stock.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    initial = model.get_weights()
    detector = callbacks.NaNOnsetDetector(check_every=3)
    fit(model, x, y, [detector], epochs=1)
    report = detector.report
    assert (report["batch"], report["kind"], report["rows"]) == (7, "inputs", [2])
    # Checks before batches 3, 6, 9 and 12: the one at 12 reads the record
    # as of step 8 and stops; step 12 runs held. 2 * 3 steps after the onset.
    assert model._nan_link.watch.read().steps == 13
    assert int(model.optimizer.iterations.value) == 7
    trained = model.get_weights()
    stock.set_weights(initial)
    fit(stock, x[:56], y[:56], None, epochs=1)  # the 7 batches before the onset
    for ours, theirs in zip(trained, stock.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert [row["batch"] for row in report["history"]] == list(range(8))


def test_nan_detector_names_the_batch_with_several_steps_per_execution(devices):
    x, y, _ = regression_data(80)
    x[37, 0] = np.nan  # batch 4, row 5
    model = mlp(steps=2)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=3)
    detector = callbacks.NaNOnsetDetector(check_every=2)
    fit(model, x, y, [detector])
    report = detector.report
    assert (report["epoch"], report["batch"], report["kind"], report["rows"]) == (0, 4, "inputs", [5])
    assert not keras_safe_dist.backend.jax.nan_locate.nonfinite_weights(model)


def test_nan_detector_restore_puts_back_the_weights_before_the_update_that_overflowed(devices):
    x, y, _ = regression_data(40)
    detector = callbacks.NaNOnsetDetector(action="restore")
    model = mlp(learning_rate=1e37)
    model.global_clipnorm = None
    initial = model.get_weights()
    fit(model, x * 1e3, y * 1e3, [detector])
    report = detector.report
    assert (report["batch"], report["kind"]) == (0, "weights")
    assert report["restored_to"] == "before this batch"
    for restored, before in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(restored, before)


def test_a_safe_models_fixes_are_its_own_not_a_plain_models(devices):
    # The weights overflowed by one huge step: the fix is a lower learning rate,
    # as on TensorFlow (it was the plain keras.Model's "use SafeDistributedModel").
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(1, keepdims=True)

    class Spike(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return ops.where(step == 3, 1e38, 0.01)

    def two_dense(**options):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        return SafeDistributedModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)), **options)

    model = two_dense()
    model.compile(keras.optimizers.SGD(Spike()), "mse")
    detector = callbacks.NaNOnsetDetector(action="stop")
    fit(model, x, y, [detector], epochs=1)
    report = detector.report
    assert (report["batch"], report["kind"], report["localized"], report["plain_model"]) == (3, "weights", True, False)
    assert report["finding"]["fix"] == (
        "Lower the learning rate or clip gradients with global_clipnorm: the update "
        "overflowed the weights."
    )
    # skip_nonfinite=False applies the update: the batch is not replayed, and
    # the fix says how to have it replayed (it said to use SafeDistributedModel).
    x, y, _ = regression_data(64)
    x[21, 2] = np.nan
    model = two_dense(skip_nonfinite=False)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    detector = callbacks.NaNOnsetDetector(action="stop")
    fit(model, x, y, [detector], epochs=1)
    report = detector.report
    assert (report["batch"], report["kind"], report["localized"]) == (2, "loss", False)
    assert report["finding"]["fix"] == onset_report.UNREPLAYED_FIXES["loss"]
    assert "train with keras_safe_dist.SafeDistributedModel" not in report["summary"]


def test_nan_detector_reads_the_loss_of_a_plain_keras_model(devices):
    x, y, _ = regression_data(40)
    x[13, 0] = np.nan
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(inputs))
    model.compile(optimizer="sgd", loss="mse")
    detector = callbacks.NaNOnsetDetector(action="restore")
    fit(model, x, y, [detector])
    report = detector.report
    # Only the logged loss: the kind is `loss`, the batch the one the loss showed.
    assert (report["batch"], report["kind"], report["localized"]) == (1, "loss", False)
    assert report["variables"] == ["dense/kernel", "dense/bias"]  # the NaN update was applied
    assert report["restored_to"] == "before this batch"
    assert not keras_safe_dist.backend.jax.nan_locate.nonfinite_weights(model)
    # Where the loss turned non-finite was not located: the report does not
    # say the inputs and layer outputs were finite.
    assert "a non-finite loss (where it began was not located)" in report["summary"]
    assert "finite inputs" not in report["summary"]
    assert "finite inputs" not in report["finding"]["message"]


@pytest.mark.parametrize(
    "steps_per_execution, onsets", [(1, (4, 5)), (3, (4, 5, 6))]
)
def test_nan_detector_stops_within_its_stated_steps_and_keeps_the_onset_batch(
    devices, steps_per_execution, onsets
):
    # The checks fall every check_every steps rounded up to whole executions
    # (2 here, or 3 with 3 steps per execution). Onsets at every phase of one
    # interval: the batch is still kept to be replayed, and the most steps
    # that run after the onset is `steps_to_stop`, reached.
    nan_watch = keras_safe_dist.backend.jax.nan_watch
    bound = nan_watch.steps_to_stop(2, steps_per_execution)
    assert bound == {1: 4, 3: 8}[steps_per_execution]
    after = []
    for onset in onsets:
        x, y, _ = regression_data(200)
        x[8 * onset + 1, 0] = np.nan
        inputs = keras.Input((4,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
        detector = callbacks.NaNOnsetDetector(check_every=2)
        fit(model, x, y, [detector], epochs=1)
        report = detector.report
        assert (report["batch"], report["kind"], report["rows"]) == (onset, "inputs", [1])
        assert model._nan_link.watch.batches.maxlen == nan_watch.kept_batches(
            2, steps_per_execution, 1
        )
        after.append(model._nan_link.watch.read().steps - 1 - onset)
    assert max(after) == bound, after


# Audits


def test_two_nan_detectors_in_one_fit_are_refused_before_a_step():
    x, y, _ = regression_data(16)
    model = mlp()
    initial = model.get_weights()
    detectors = [callbacks.NaNOnsetDetector(), [callbacks.NaNOnsetDetector(action="continue")]]
    with pytest.raises(ValueError, match="received 2 NaN onset detectors.*Pass one NaNOnsetDetector per fit"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=detectors)
    for kept, value in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(kept, value)


def test_check_every_warns_only_where_it_has_no_effect():
    x, y, _ = regression_data(16)
    with pytest.warns(UserWarning, match=r"check_every=5 has no effect here.*With Functional on jax every step's logs are checked"):
        _stock_model().fit(x, y, batch_size=8, verbose=0, callbacks=[callbacks.NaNOnsetDetector(check_every=5)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlp().fit(x, y, batch_size=8, verbose=0, callbacks=[callbacks.NaNOnsetDetector(check_every=5)])


def test_one_callback_not_in_a_list_is_taken_as_stock_takes_it():
    x, y, _ = regression_data(16)
    seen = []
    callback = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch))
    stock = _stock_model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callback)
    history = mlp().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callback)
    assert seen == [0, 1, 0, 1]
    assert list(history.history) == list(stock.history) == ["loss"]


def _stock_model():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_audit_says_once_that_tf_distribute_checks_do_not_apply(devices):
    model = mlp()
    report = keras_safe_dist.audit(model)
    assert report.codes() == ("JAX001",)
    (finding,) = report.findings
    assert finding.severity == "info"
    assert "AGG* (aggregation), SCOPE* (scope), DIST* (stock model)" in finding.message


def test_a_run_with_every_audit_callback_reports_one_jax001_naming_them(tmp_path):
    from keras_safe_dist.report import format_text

    x, y, _ = regression_data(16)
    audits = [
        callbacks.AggregationAudit(log_dir=str(tmp_path)),
        callbacks.ScopeAudit(log_dir=str(tmp_path)),
        callbacks.TrainingModeAudit(log_dir=str(tmp_path)),
    ]
    fit(mlp(), x, y, audits)
    assert [a.report.codes() for a in audits] == [("JAX001",)] * 3  # each audit says what it ran
    report = read_log_dir(str(tmp_path))
    (jax001,) = [f for f in report.findings() if f.code == "JAX001"]
    assert jax001.subject == "the audits on JAX"
    for name in ("AggregationAudit ran no check", "ScopeAudit ran no check",
                 "TrainingModeAudit ran MODE001 and MODE003"):
        assert f"On JAX, {name}" in jax001.message
    rows = [line for line in format_text(report).splitlines() if "| JAX001 |" in line]
    assert len(rows) == 1
    # One sentence per audit: the row reads at a glance (it was about 1,000 characters).
    assert len(jax001.message) < 400, jax001.message  # 346 here
    assert jax001.message.count("do not apply") == 3


def test_audit_still_flags_a_frozen_batch_norm(devices):
    inputs = keras.Input((4,))
    norm = keras.layers.BatchNormalization(name="norm")
    norm.trainable = False
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(norm(inputs)))
    assert keras_safe_dist.audit(model).codes() == ("MODE003", "JAX001")


@pytest.mark.parametrize("audit_class", [callbacks.ScopeAudit, callbacks.AggregationAudit])
def test_strategy_audits_report_one_info_finding(tmp_path, devices, audit_class):
    x, y, _ = regression_data(44)
    audit = audit_class(log_dir=str(tmp_path), on_finding="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error", callbacks.AuditWarning)
        fit(mlp(), x, y, [audit])
    assert audit.report.codes() == ("JAX001",)
    assert audit.report.counts() == {"error": 0, "warning": 0, "info": 1}
    with open(tmp_path / f"audit_{audit.name}.json") as f:
        assert [f_["code"] for f_ in json.load(f)["findings"]] == ["JAX001"]


class FrozenModeModel(SafeDistributedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization()
        self.drop = keras.layers.Dropout(0.5, seed=1)
        self.out = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.out(self.drop(self.norm(x, training=False), training=False))


def test_training_mode_audit_passes_a_training_model(devices):
    inputs = keras.Input((4,))
    x = keras.layers.Dropout(0.5, seed=1)(keras.layers.BatchNormalization()(inputs))
    model = SafeDistributedModel(inputs, keras.layers.Dense(1)(x))
    model.compile("sgd", "mse")
    x_, y, _ = regression_data(44)
    audit = callbacks.TrainingModeAudit(check_after_steps=2, on_finding="raise")
    fit(model, x_, y, [audit], epochs=1)
    assert audit.report.codes() == ("JAX001",)


def test_training_mode_audit_flags_layers_called_in_inference_mode(devices):
    model = FrozenModeModel()
    model.compile("sgd", "mse")
    x, y, _ = regression_data(44)
    model(x[:2])  # builds the layers, so that the audit watches them from the start
    audit = callbacks.TrainingModeAudit(check_after_steps=2, on_finding="ignore")
    fit(model, x, y, [audit], epochs=1)
    mode = [f for f in audit.report.findings if f.code == "MODE001"]
    assert len(mode) == 2
    # Named by path where the layer has one (the BatchNormalization), else by name.
    assert {f.subject for f in mode} == {model.norm.path, model.drop.name}


# keras-safe-dist report


def test_report_reads_a_jax_run(tmp_path, devices, capsys):
    x, y, _ = regression_data(44)
    x[:, :] = np.abs(x) + 0.5
    x[30, 0] = -4.0
    log_dir = str(tmp_path)
    cbs = [
        callbacks.ScopeAudit(log_dir=log_dir),
        callbacks.AggregationAudit(log_dir=log_dir),
        callbacks.TrainingModeAudit(log_dir=log_dir),
        callbacks.Dashboard(log_dir),
        callbacks.NaNOnsetDetector(log_dir=log_dir),
    ]
    fit(mlp(root="activation"), x, y, cbs, epochs=1)
    report = read_log_dir(log_dir)
    assert sorted(a.name for a in report.audits) == ["aggregation", "scope", "training_mode"]
    code = cli.main(["report", log_dir])
    out = capsys.readouterr().out
    assert code == 1  # the NaN onset is an error finding
    assert "NAN001" in out and "JAX001" in out
    assert "epoch 0, batch 3" in out
    assert glob.glob(os.path.join(log_dir, "safe_distributed", "events.*"))


def test_nan_detector_restore_puts_back_the_weights_before_an_epoch_s_last_update(devices):
    # The epoch's last update overflows the weights with a finite gradient:
    # no later step sees it; the epoch-end check does, and the copy kept in
    # the step (from the start of that last step) is put back.
    x, y, _ = regression_data(16)  # 2 batches of 8: the second update overflows
    model = mlp(learning_rate=0.01)
    model.global_clipnorm = None
    detector = callbacks.NaNOnsetDetector(action="restore")

    class Overflow(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                self.before = [np.array(w) for w in self.model.get_weights()]
                self.model.optimizer.learning_rate.assign(np.inf)

    overflow = Overflow()
    fit(model, x, y, [overflow, detector], epochs=1)
    report = detector.report
    assert (report["batch"], report["kind"]) == (1, "weights")
    assert report["restored_to"] == "before this batch"
    for restored, before in zip(model.get_weights(), overflow.before):
        np.testing.assert_array_equal(restored, before)


class _Logs(keras.callbacks.Callback):
    """The keys of each step's logs, and of each epoch's."""

    def on_train_begin(self, logs=None):
        self.steps, self.epochs = set(), set()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.update(logs or {})

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.update(logs or {})


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_the_nan_record_never_reaches_the_logs_keras_and_callbacks_see(devices, steps_per_execution):
    # The step returns its record in its logs for the detector (nan_watch's
    # RECORD_LOG); the train function takes it out before Keras has them.
    x, y, _ = regression_data(48)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    seen = _Logs()
    history = fit(model, x, y, [callbacks.NaNOnsetDetector(check_every=2), seen])
    assert seen.steps == {"loss"}
    assert seen.epochs == {"loss"}
    assert set(history.history) == {"loss"}
    logs = model.train_on_batch(x[:8], y[:8], return_dict=True)
    assert set(logs) == {"loss"}
