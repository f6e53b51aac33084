"""The NaN onset report's text: each kind's fix is one that can repair that kind."""

import pytest

from keras_safe_dist.nan import onset_report as nan_report


def onset(kind, localized=True):
    return {
        "epoch": 0,
        "batch": 3,
        "kind": kind,
        "layer": "safe_log" if kind == "activations" else None,
        "variables": ["dense/kernel"] if kind in ("gradients", "weights") else [],
        "replicas": [1],
        "history": [{"loss": 0.5}],
        "localized": localized,
        "notes": [],
        "files": {},
    }


def test_every_kind_the_detector_reports_has_its_own_fix():
    assert set(nan_report.KINDS) == {"inputs", "loss", "activations", "gradients", "weights"}
    fixes = [nan_report.fix_for(onset(kind)) for kind in nan_report.KINDS]
    assert len(set(fixes)) == len(fixes)


def test_inputs_fix_points_at_the_batch_and_the_data_pipeline():
    fix = nan_report.fix_for(onset("inputs"))
    assert "nan_onset_batch.npz" in fix and "data pipeline" in fix
    assert "learning rate" not in fix and "clip" not in fix


def test_loss_fix_guards_the_loss_function():
    fix = nan_report.fix_for(onset("loss"))
    assert fix.startswith("Guard the loss function") and "epsilon" in fix
    assert "from_logits=True" in fix and "global_clipnorm" not in fix


def test_activations_fix_guards_the_layer_and_names_float32_for_float16():
    fix = nan_report.fix_for(onset("activations"))
    assert fix.startswith("Guard that layer's computation") and "epsilon" in fix
    assert 'dtype="float32"' in fix and "global_clipnorm" not in fix


def test_gradients_fix_makes_the_backward_op_safe_and_never_suggests_clipping():
    # A NaN or inf gradient stays non-finite whatever clipping or learning rate.
    fix = nan_report.fix_for(onset("gradients"))
    assert "global_clipnorm" not in fix and "clipnorm" not in fix
    assert "lower the learning rate" not in fix.lower()
    for op in ("sqrt", "pow", "tf.where", "sqrt(x + epsilon)"):
        assert op in fix
    assert "cannot repair a NaN or inf gradient" in fix
    assert "LossScaleOptimizer" in fix


def test_weights_fix_bounds_the_update_made_from_finite_gradients():
    fix = nan_report.fix_for(onset("weights"))
    assert fix == (
        "Lower the learning rate or clip gradients with global_clipnorm: the update "
        "overflowed the weights."
    )


@pytest.mark.parametrize("kind", ["loss", "weights"])
def test_plain_model_fix_does_not_assume_a_cause_it_did_not_localize(kind):
    fix = nan_report.fix_for(onset(kind, localized=False))
    assert fix == nan_report.PLAIN_FIXES[kind]
    assert "SafeDistributedModel" in fix
    if kind == "weights":
        # Clipping is offered only for the case of finite gradients.
        assert fix.index("if they were finite") < fix.index("global_clipnorm")


@pytest.mark.parametrize("kind", sorted(nan_report.KINDS))
def test_finding_and_paragraph_carry_the_kind_fix(kind):
    report = nan_report.finish(onset(kind), "stop", 10)
    fix = nan_report.fix_for(report)
    assert report["finding"]["fix"] == fix
    assert report["summary"].endswith(f"Fix: {fix}")
    assert report["finding"]["message"] == f"{nan_report.KINDS[kind][0]} at epoch 0, batch 3"


@pytest.mark.parametrize("kind", ["loss", "gradients"])
def test_a_safe_models_unreplayed_onset_says_how_to_have_it_replayed(kind):
    report = dict(onset(kind, localized=False), plain_model=False)
    fix = nan_report.fix_for(report)
    assert fix == nan_report.UNREPLAYED_FIXES[kind]
    assert "action='restore'" in fix and "use keras_safe_dist.SafeDistributedModel" not in fix
    # Located, the kind's own fix; a plain model's, the plain fix.
    assert nan_report.fix_for(dict(report, localized=True)) == nan_report.KINDS[kind][1]
    if kind in nan_report.PLAIN_FIXES:
        assert nan_report.fix_for(dict(report, plain_model=True)) == nan_report.PLAIN_FIXES[kind]
