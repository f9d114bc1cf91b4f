"""Vision at startup: ``EngineOptions.vision`` resolved against the artifact (auto: on with a tower), the tower's
weights and the encoder's workspace (``max_encode_rows`` rows of ``ModelProfile.encoder_bytes_per_row``) in the
plan."""

from __future__ import annotations

import pytest
from ninfer import EngineOptions
from ninfer.contracts.options import DEFAULT_MAX_ENCODE_ROWS, InvalidEngineOptions
from ninfer.planning.planner import artifact_profile, plan


@pytest.fixture(scope="module")
def vision_artifact(tmp_path_factory):
    from support.vision_models import tiny_vision_artifact

    return tiny_vision_artifact(tmp_path_factory.mktemp("vision_plan"))[0]


def opts(**kw) -> EngineOptions:
    return EngineOptions(device="cpu", dtype="float32", max_context=256, **kw)


def test_vision_is_resolved_against_the_artifact(vision_artifact, tiny_moe_artifact):
    auto = artifact_profile(vision_artifact, opts())
    off = artifact_profile(vision_artifact, opts(vision=False))
    assert auto.options.options.vision is True and off.options.options.vision is False
    tower = [s for s in auto.parameter_specs if s.component == "vision"]
    assert tower and not [s for s in off.parameter_specs if s.component == "vision"]
    assert auto.profile.weight_bytes > off.profile.weight_bytes
    assert auto.profile.encoder_bytes_per_row > 0 and off.profile.encoder_bytes_per_row == 0
    # A causal_scoring engine scores text: auto leaves the tower out.
    assert artifact_profile(vision_artifact, opts(purpose="causal_scoring")).options.options.vision is False
    assert artifact_profile(tiny_moe_artifact, opts()).options.options.vision is False
    with pytest.raises(InvalidEngineOptions, match="no vision tower"):
        artifact_profile(tiny_moe_artifact, opts(vision=True))


def test_the_encoder_workspace_is_planned_for_max_encode_rows(vision_artifact):
    per_row = artifact_profile(vision_artifact, opts()).profile.encoder_bytes_per_row
    default = plan(vision_artifact, opts()).memory
    small = plan(vision_artifact, opts(max_encode_rows=1000)).memory
    large = plan(vision_artifact, opts(max_encode_rows=3000)).memory
    assert large.workspace_bytes - small.workspace_bytes == 2000 * per_row
    assert default.workspace_bytes - small.workspace_bytes == (DEFAULT_MAX_ENCODE_ROWS - 1000) * per_row
    off = plan(vision_artifact, opts(vision=False, max_encode_rows=3000)).memory
    assert off.workspace_bytes == small.workspace_bytes - 1000 * per_row


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_max_encode_rows_is_checked(bad):
    with pytest.raises(InvalidEngineOptions, match="max_encode_rows"):
        EngineOptions(max_encode_rows=bad).validate()


def test_vision_options_are_checked():
    with pytest.raises(InvalidEngineOptions, match="vision with speculative decoding"):
        EngineOptions(vision=True, speculative="mtp").validate()
    with pytest.raises(InvalidEngineOptions, match="scores text only"):
        EngineOptions(vision=True, purpose="causal_scoring").validate()
    with pytest.raises(InvalidEngineOptions, match="True, False or None"):
        EngineOptions(vision="yes").validate()
    assert EngineOptions(vision=None, speculative="mtp").validate().features().vision is False
