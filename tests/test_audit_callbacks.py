"""The audit callbacks during fit(): findings, actions, silencing and TensorBoard."""

import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist.report import writer as summaries

from conftest import SumCounter
from conftest import mirrored_strategy
from conftest import strategy_for

X = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
Y = X[:, :1] * 2.0


class LastMean(keras.layers.Layer):
    """Keeps the mean of each replica's last batch in a mirrored variable (MODE002)."""

    def build(self, shape):
        self.last = self.add_weight(shape=(), initializer="zeros", trainable=False, name="last")

    def call(self, x, training=False):
        if training:
            self.last.assign(keras.ops.mean(x))
        return x


class InferenceModeStep(keras.Model):
    """A custom train step that calls the model with training=False (MODE001)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=False))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def audit_warnings(record):
    """The audits' own warnings in `record`: stock Keras <= 3.13 with numpy >= 2.1
    adds numpy's `__array__` copy-keyword DeprecationWarning every step."""
    return [w for w in record if issubclass(w.category, callbacks.AuditWarning)]


def build(strategy, *layers, cls=keras.Model, **compile_kwargs):
    with strategy.scope():
        inputs = keras.Input((3,))
        outputs = inputs
        for layer in layers:
            outputs = layer(outputs)
        model = cls(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse", **compile_kwargs)
    return model


def fit(model, *cbs, epochs=1):
    model.fit(X, Y, batch_size=4, epochs=epochs, verbose=0, callbacks=list(cbs))


def test_aggregation_audit_flags_an_on_write_sum_variable_at_train_begin(replicas):
    model = build(strategy_for(replicas), SumCounter(name="counter"), keras.layers.Dense(1))
    audit = callbacks.AggregationAudit(on_finding="ignore")
    fit(model, audit)
    expected = [("AGG003", "error", "counter/count")]
    if replicas == 2:  # a stock model's loss on batches that split unevenly
        expected.append(("DIST004", "info", f"model '{model.name}' loss"))
    assert [(f.code, f.severity, f.subject) for f in audit.report] == expected
    rows = {v.path: v for v in audit.variables}
    assert rows["counter/count"].container == ("plain" if replicas == 1 else "mirrored")
    assert any(v.role == "optimizer-state" for v in audit.variables)



def test_aggregation_audit_warns_once_of_a_stock_sequential_clipping_per_replica():
    with strategy_for(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(global_clipnorm=1.0), loss="mse")
    audit = callbacks.AggregationAudit()
    with pytest.warns(callbacks.AuditWarning) as caught:
        fit(model, audit, epochs=2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("aggregation audit: 1 error, 0 warnings, 1 info (DIST001, DIST004)")
    assert "[DIST001] error optimizer '" in message
    assert "Fix: Move it to SafeDistributedModel" in message


@pytest.mark.parametrize(
    "cls,replicas",
    [(keras.Model, 1), (SafeDistributedModel, 1), (SafeDistributedModel, 2)],
    ids=["stock-1replica", "safe-1replica", "safe-2replicas"],
)
def test_aggregation_audit_is_silent_on_a_safe_model_and_on_one_device(cls, replicas):
    model = build(strategy_for(replicas), keras.layers.Dense(1), cls=cls)
    audit = callbacks.AggregationAudit(on_finding="raise")
    fit(model, audit)
    assert audit.report.codes() == ()


@pytest.mark.parametrize("cls", [keras.Model, SafeDistributedModel], ids=["stock", "safe"])
def test_scope_audit_flags_a_variable_created_by_a_callback_during_fit(cls):
    class LateVariable(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.created = keras.Variable(0.0, name="late_counter")

    model = build(mirrored_strategy(), keras.layers.Dense(1), cls=cls)
    audit = callbacks.ScopeAudit(on_finding="ignore")
    fit(model, audit, LateVariable(), epochs=2)
    (finding,) = audit.report.findings
    assert (finding.code, finding.severity, finding.subject) == ("SCOPE005", "error", "variable 'late_counter'")
    assert "by test_audit_callbacks.py:" in finding.message
    assert "in LateVariable.on_epoch_begin" in finding.message
    # The watch stops with training.
    keras.Variable(0.0, name="after_fit")
    assert len(audit.report) == 1


def test_scope_audit_is_silent_at_one_replica_and_for_variables_created_in_scope(replicas):
    strategy = strategy_for(replicas)

    class ScopedVariable(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            with self.model.distribute_strategy.scope():
                self.created = keras.Variable(0.0, name="scoped")

    model = build(strategy, keras.layers.Dense(1))
    audit = callbacks.ScopeAudit(on_finding="raise")
    fit(model, audit, ScopedVariable())
    assert len(audit.report) == 0


def test_training_mode_audit_flags_layers_run_in_inference_mode(replicas):
    model = build(
        strategy_for(replicas),
        keras.layers.Dense(4),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dropout(0.5, name="drop"),
        keras.layers.Dense(1),
        cls=InferenceModeStep,
    )
    audit = callbacks.TrainingModeAudit(on_finding="ignore")
    fit(model, audit)
    assert [(f.code, f.severity, f.subject) for f in audit.report] == [
        ("MODE001", "error", "bn"),
        ("MODE001", "error", "drop"),
    ]
    assert "moving mean and variance did not move" in audit.report.findings[0].message


def test_training_mode_audit_flags_state_that_differs_across_replicas():
    model = build(mirrored_strategy(), LastMean(name="last_mean"), keras.layers.Dense(1))
    audit = callbacks.TrainingModeAudit(on_finding="ignore")
    fit(model, audit)
    (finding,) = audit.report.findings
    assert (finding.code, finding.severity, finding.subject) == ("MODE002", "error", "last_mean/last")
    assert "differ across the 2 replicas" in finding.message


def test_training_mode_audit_reports_per_replica_batch_norm_statistics_as_info():
    model = build(mirrored_strategy(), keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1))
    audit = callbacks.TrainingModeAudit(on_finding="raise")
    fit(model, audit)
    assert [(f.code, f.severity, f.subject) for f in audit.report] == [("MODE004", "info", "bn")]
    synced = build(mirrored_strategy(), keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(1))
    audit = callbacks.TrainingModeAudit(on_finding="raise")
    fit(synced, audit)
    assert len(audit.report) == 0


def test_training_mode_audit_flags_a_frozen_batch_norm(replicas):
    frozen = keras.layers.BatchNormalization(name="frozen")
    frozen.trainable = False
    model = build(strategy_for(replicas), frozen, keras.layers.Dense(1))
    audit = callbacks.TrainingModeAudit(on_finding="ignore")
    fit(model, audit)
    assert [(f.code, f.severity, f.subject) for f in audit.report] == [("MODE003", "warning", "frozen")]


def test_training_mode_audit_checks_after_the_chosen_step_even_in_a_short_run():
    model = build(strategy_for(1), keras.layers.Dense(2), keras.layers.Dropout(0.5, name="drop"), cls=InferenceModeStep)
    audit = callbacks.TrainingModeAudit(check_after_steps=100, on_finding="ignore")
    fit(model, audit)  # 4 steps: checked at train end
    assert audit.report.codes() == ("MODE001",)


def test_on_finding_warn_raise_and_ignore():
    def run(**kwargs):
        model = build(strategy_for(1), SumCounter(), keras.layers.Dense(1))
        audit = callbacks.AggregationAudit(**kwargs)
        fit(model, audit)
        return audit

    with pytest.warns(callbacks.AuditWarning, match=r"aggregation audit: 1 error, 0 warnings, 0 info \(AGG003\)\n\[AGG003\] error sum_counter/count: on-write"):
        run()
    with pytest.raises(callbacks.AuditError, match="AGG003") as raised:
        run(on_finding="raise")
    assert raised.value.report.codes() == ("AGG003",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(on_finding="ignore").report.codes() == ("AGG003",)
        assert len(run(ignore=["AGG003"]).report) == 0
        assert len(run(ignore=(code for code in ["AGG003"])).report) == 0  # read once
        assert run(ignore=iter(()), on_finding="ignore").ignore == ()


def test_one_callback_object_reports_each_fit_afresh():
    audit = callbacks.AggregationAudit(on_finding="ignore")
    fit(build(strategy_for(1), SumCounter(), keras.layers.Dense(1)), audit)
    assert len(audit.report) == 1
    fit(build(strategy_for(1), keras.layers.Dense(1)), audit)
    assert len(audit.report) == 0


def read_events(log_dir):
    # Kept: events at a step already written (a purge would hide them).
    accumulator = event_accumulator.EventAccumulator(
        log_dir, size_guidance={"tensors": 0}, purge_orphaned_data=False
    )
    accumulator.Reload()
    return accumulator


def scalar_series(events, tag):
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]


def test_reports_are_written_for_tensorboard_and_as_json(tmp_path, replicas):
    log_dir = str(tmp_path)
    model = build(strategy_for(replicas), SumCounter(name="counter"), keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1))
    cbs = [
        callbacks.ScopeAudit(log_dir=log_dir),
        callbacks.AggregationAudit(log_dir=log_dir, on_finding="ignore"),
        callbacks.TrainingModeAudit(log_dir=log_dir),
    ]
    fit(model, *cbs)
    events = read_events(log_dir)
    assert sorted(t for t in events.Tags()["tensors"] if "/" in t and t.count("/") == 1) == [
        "audits/aggregation", "audits/scope", "audits/training_mode",
    ]
    text = tf.make_ndarray(events.Tensors("audits/aggregation")[0].tensor_proto).item().decode()
    assert text == cbs[1].report.to_markdown()
    assert "| AGG003 | error | counter/count |" in text
    errors = events.Tensors("audits/aggregation/error")[0]
    assert (errors.step, float(tf.make_ndarray(errors.tensor_proto))) == (0, 1.0)
    info = events.Tensors("audits/training_mode/info")[0]
    assert (info.step, float(tf.make_ndarray(info.tensor_proto))) == (2, 0.0 if replicas == 1 else 1.0)
    with open(os.path.join(log_dir, "audit_aggregation.json")) as f:
        data = json.load(f)
    # A stock model on 2 replicas: DIST004 (info) on unevenly split batches.
    assert data["counts"] == {"error": 1, "warning": 0, "info": replicas - 1}
    assert data["findings"][0]["subject"] == "counter/count"
    assert {v["path"] for v in data["variables"]} >= {"counter/count", "bn/moving_mean"}


def test_only_the_chief_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(summaries, "is_chief", lambda strategy=None: False)
    audit = callbacks.AggregationAudit(log_dir=str(tmp_path), on_finding="ignore")
    fit(build(strategy_for(1), SumCounter(), keras.layers.Dense(1)), audit)
    assert audit.report.codes() == ("AGG003",)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"on_finding": "loud"}, ValueError, r"`on_finding` must be one of \('warn', 'raise', 'ignore'\). Received: on_finding='loud'"),
        ({"ignore": "AGG003"}, TypeError, r"`ignore` must be a collection of finding codes, e.g. ignore=\['MODE003'\]. Received: ignore='AGG003'"),
        ({"ignore": 3}, TypeError, r"`ignore` must be a collection of finding codes, e.g. ignore=\['MODE003'\]. Received: ignore=3"),
        # A dict's keys would be taken, its values dropped: False would still ignore.
        ({"ignore": {"MODE003": False}}, TypeError, r"`ignore` must be a collection of finding codes, e.g. ignore=\['MODE003'\]. Received: ignore=\{'MODE003': False\}"),
        ({"ignore": ["AGG999"]}, ValueError, r"Unknown finding codes in `ignore`: \['AGG999'\]. Available: AGG001, "),
        ({"log_dir": 3}, TypeError, r"`log_dir` must be a path \(str or os.PathLike\) or None. Received: log_dir=3"),
    ],
)
@pytest.mark.parametrize("cls", [callbacks.AggregationAudit, callbacks.ScopeAudit, callbacks.TrainingModeAudit])
def test_callbacks_reject_bad_arguments(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("steps", [0, 1.5, True])
def test_training_mode_audit_rejects_bad_check_after_steps(steps):
    with pytest.raises(ValueError, match=f"`check_after_steps` must be an integer >= 1. Received: check_after_steps={steps!r}"):
        callbacks.TrainingModeAudit(check_after_steps=steps)


class KeepsVariables(keras.callbacks.Callback):
    """Creates a variable outside the scope at each epoch end and keeps it (SCOPE005)."""

    def on_train_begin(self, logs=None):
        self.kept = []

    def on_epoch_end(self, epoch, logs=None):
        self.kept.append(keras.Variable(0.0, name="late_counter"))


@pytest.mark.parametrize(
    "cls, make",
    [
        (keras.Model, keras.callbacks.BackupAndRestore),
        (SafeDistributedModel, callbacks.MultiWorkerBackupAndRestore),
        (keras.Model, lambda d: keras.callbacks.ModelCheckpoint(os.path.join(d, "m.weights.h5"), save_weights_only=True)),
    ],
    ids=["keras-backup", "our-backup", "checkpoint"],
)
def test_scope_audit_is_silent_on_the_variables_keras_saving_creates_and_drops(tmp_path, cls, make):
    # Each save_weights() builds a reference Optimizer(1.0) (its `iteration` and
    # `learning_rate`) outside the scope, to list attribute names, and drops it.
    model = build(mirrored_strategy(), keras.layers.Dense(1), cls=cls)
    audit = callbacks.ScopeAudit(log_dir=str(tmp_path / "logs"), on_finding="raise")
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[audit, make(str(tmp_path / "backup"))])
    assert len(audit.report) == 0
    assert scalar_series(read_events(str(tmp_path / "logs")), "audits/scope/error") == [(0, 0.0), (1, 0.0), (2, 0.0)]


@pytest.mark.parametrize("cls", [keras.Model, SafeDistributedModel], ids=["stock", "safe"])
def test_audit_callbacks_are_silent_under_one_device_strategy(cls):
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        inputs = keras.Input((3,))
        hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
        model = cls(inputs, keras.layers.Dense(1)(keras.layers.Dropout(0.5)(hidden)))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    audits = [callbacks.ScopeAudit(on_finding="raise"), callbacks.AggregationAudit(on_finding="raise"), callbacks.TrainingModeAudit(on_finding="raise")]
    fit(model, *audits, KeepsVariables(), epochs=2)  # plain variables are right here
    assert [a.report.summary() for a in audits] == [
        "scope audit: 0 errors, 0 warnings, 0 info",
        "aggregation audit: 0 errors, 0 warnings, 0 info",
        "training_mode audit: 0 errors, 0 warnings, 0 info",
    ]
    assert {v.container for v in audits[1].variables} == {"plain"}


def test_scope_audit_reports_each_finding_once_per_fit_one_step_per_epoch(tmp_path):
    log_dir = str(tmp_path)
    model = build(mirrored_strategy(), keras.layers.Dense(1))
    audit = callbacks.ScopeAudit(log_dir=log_dir)
    for _ in range(2):  # the same callback object: each fit warns afresh
        with pytest.warns(callbacks.AuditWarning) as record:
            fit(model, audit, KeepsVariables(), epochs=3)
        warned = audit_warnings(record)
        assert len(warned) == 1
        assert str(warned[0].message).startswith("scope audit: 1 error, 0 warnings, 0 info (SCOPE005)\n[SCOPE005] error variable 'late_counter'")
        (finding,) = audit.report.findings
        assert "(3 variables of this name)" in finding.message
    with open(os.path.join(log_dir, "audit_scope.json")) as f:
        assert [f["subject"] for f in json.load(f)["findings"]] == ["variable 'late_counter'"]
    # Created in on_epoch_end after ScopeAudit's: counted in that epoch's report.
    series = [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0)]
    assert scalar_series(read_events(log_dir), "audits/scope/error") == series * 2


def test_scope_audit_stops_watching_when_it_raises():
    model = build(mirrored_strategy(), keras.layers.Dense(1))
    audit = callbacks.ScopeAudit(on_finding="raise")
    with pytest.raises(callbacks.AuditError, match=r"\[SCOPE005\] error variable 'late_counter'"):
        fit(model, audit, KeepsVariables(), epochs=3)
    assert audit._watch is None  # fit() calls no on_train_end after an error


def test_aggregation_audit_warns_once_when_it_reports_again_after_the_first_epoch(tmp_path):
    model = build(strategy_for(1), SumCounter(name="counter"), keras.layers.Dense(1), metrics=["mae"])
    audit = callbacks.AggregationAudit(log_dir=str(tmp_path))
    with pytest.warns(callbacks.AuditWarning) as record:
        fit(model, audit, epochs=2)
    assert len(audit_warnings(record)) == 1
    # Reported again at step 1: the first step built the metric.
    assert scalar_series(read_events(str(tmp_path)), "audits/aggregation/error") == [(0, 1.0), (1, 1.0)]
    assert audit.report.codes() == ("AGG003",)


@pytest.mark.parametrize("cls", [keras.Model, SafeDistributedModel], ids=["stock", "safe"])
def test_audits_are_silent_beside_every_keras_callback_and_ours(tmp_path, replicas, cls):
    # A correct setup from Keras's and TensorFlow's guides, with the callbacks
    # users add: the audits, set to raise, find nothing in it.
    model = build(strategy_for(replicas), keras.layers.Dense(4), keras.layers.Dense(1), cls=cls)
    logs = str(tmp_path / "logs")
    audits = [
        callbacks.ScopeAudit(log_dir=logs, on_finding="raise"),
        callbacks.AggregationAudit(log_dir=logs, on_finding="raise"),
        callbacks.TrainingModeAudit(log_dir=logs, on_finding="raise"),
    ]
    others = [
        callbacks.NaNOnsetDetector(log_dir=logs),
        callbacks.Dashboard(logs),
        callbacks.MultiWorkerBackupAndRestore(str(tmp_path / "backup")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), save_best_only=True, monitor="loss"),
        keras.callbacks.EarlyStopping(monitor="loss", patience=5),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1),
        keras.callbacks.TensorBoard(logs),
    ]
    fit(model, *audits, *others, epochs=3)
    # A stock model on 2 replicas gets only the info on unevenly split batches.
    stock_info = " (DIST004)" if cls is keras.Model and replicas == 2 else ""
    assert [a.report.summary() for a in audits] == [
        "scope audit: 0 errors, 0 warnings, 0 info",
        f"aggregation audit: 0 errors, 0 warnings, {len(stock_info) and 1} info{stock_info}",
        "training_mode audit: 0 errors, 0 warnings, 0 info",
    ]
    assert int(model.optimizer.iterations.numpy()) == 12
