"""`keras_safe_dist.audit()` on JAX: what ran (`JAX001`) and variables off the distribution (`JAX002`)."""

import pathlib

import jax
import keras

import keras_safe_dist
from keras_safe_dist import SafeDistributedModel
from keras_safe_dist.audits.jax_backend import not_applicable

_SUMMARY = (
    "6 of 6 variables of the model, optimizer and metrics are not laid out as DataParallel "
    "over 2 devices lays out their variables (dense/kernel is on cpu:0, not P(None, None) "
    "over 2 devices; dense/bias is on cpu:0, not P(None,) over 2 devices; "
    "batch_normalization/gamma is on cpu:0, not P(None,) over 2 devices; and 3 more): they "
    "were created before `keras.distribution.set_distribution(...)` (or outside "
    "`distribution.scope()`, or under another distribution), so they stay where they "
    "were created; "
)
_FIX = (
    "Call `keras.distribution.set_distribution(...)` before creating the model, the "
    "optimizer and the metrics (or create them under `distribution.scope()`)."
)


def _model(model_class):
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, name="dense")
    hidden = keras.layers.BatchNormalization(name="batch_normalization")(dense(inputs))
    return model_class(inputs, hidden)


def _distributed():
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))


def test_a_model_built_before_the_distribution_is_jax002_saying_fit_lays_it_out():
    model = _model(SafeDistributedModel)
    _distributed()
    report = keras_safe_dist.audit(model)
    assert report.codes() == ("JAX002", "JAX001")
    finding = report.findings[0]
    assert (finding.severity, finding.subject) == ("warning", f"model '{model.name}'")
    assert finding.message == _SUMMARY + (
        "SafeDistributedModel lays them out on the distribution once, before its first "
        "step, and warns."
    )
    assert finding.fix == _FIX


def test_a_stock_model_built_before_the_distribution_is_jax002_saying_fit_fails():
    model = _model(keras.Model)
    _distributed()
    (finding, _) = keras_safe_dist.audit(model).findings
    assert finding.message == _SUMMARY + (
        "keras.Model.fit() fails on them with 'Received incompatible devices for jitted "
        "computation'."
    )


def test_a_model_built_under_the_distribution_or_without_one_has_no_jax002():
    assert keras_safe_dist.audit(_model(SafeDistributedModel)).codes() == ("JAX001",)
    _distributed()
    assert keras_safe_dist.audit(_model(SafeDistributedModel)).codes() == ("JAX001",)


def test_jax001_of_audit_says_what_ran_and_what_does_not_apply():
    (finding,) = keras_safe_dist.audit(_model(SafeDistributedModel)).findings
    assert finding.severity == "info"
    assert finding.message == (
        "On JAX, audit() ran MODE003 and JAX002; AGG* (aggregation), SCOPE* (scope), DIST* "
        "(stock model) are tf.distribute's checks and do not apply."
    )
    assert finding.fix == (
        "Nothing to fix: those checks run on the TensorFlow backend under a tf.distribute "
        "strategy (why each does not apply on JAX: docs/audits.md, 'On the JAX backend')."
    )


def test_jax001_of_the_training_mode_audit_says_it_ran_mode001_and_mode003():
    finding = not_applicable("TrainingModeAudit", ("replica copies",))
    assert finding.message == (
        "On JAX, TrainingModeAudit ran MODE001 and MODE003; MODE002, MODE004 (replica copies) "
        "are tf.distribute's checks and do not apply."
    )


def test_jax001_of_an_audit_with_nothing_to_run_says_so():
    finding = not_applicable("ScopeAudit", ("scope",))
    assert finding.message == (
        "On JAX, ScopeAudit ran no check; SCOPE* (scope) are tf.distribute's checks and do not apply."
    )


def test_the_reasons_jax001_points_at_are_in_the_docs():
    # The message names the codes only; docs/audits.md gives each family's reason.
    from keras_safe_dist.audits.jax_backend import NOT_ON_JAX

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "audits.md").read_text()
    section = text[text.index("## On the JAX backend") :]
    for family, (codes, why) in NOT_ON_JAX.items():
        assert f"| {codes} ({family}) | {why} |" in section


def test_the_jax_codes_are_registered_and_documented():
    from keras_safe_dist.findings import CODES

    documented = (pathlib.Path(__file__).parents[1] / "docs" / "audits.md").read_text()
    assert [code for code in CODES if code.startswith("JAX")] == ["JAX001", "JAX002"]
    assert (CODES["JAX001"].severity, CODES["JAX002"].severity) == ("info", "warning")
    for code in ("JAX001", "JAX002"):
        assert f"| {code} | {CODES[code].severity} |" in documented
