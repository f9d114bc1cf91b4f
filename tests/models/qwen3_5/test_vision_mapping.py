"""The vision component's conversion plan: the tensor set and shapes the vision config implies, exactly; the
compact vision config and its refusals. On the plan alone (no tensor data)."""

from __future__ import annotations

import pytest
from ninfer.artifact.source_mapping import SourceTensor
from ninfer.contracts.features import StartupFeatures
from ninfer.errors import NotSupportedError
from ninfer_qwen3_5.config import Qwen35ConfigError
from ninfer_qwen3_5.mapping import Qwen35SourceMapping
from ninfer_qwen3_5.parameters import parameter_specs
from ninfer_qwen3_5.vision.config import VisionConfig
from ninfer_qwen3_5.vision.parameters import source_name, vision_shapes

H = 8
TEXT = dict(vocab_size=32, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=4, linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=4,
            linear_num_key_heads=1, linear_num_value_heads=2, intermediate_size=6,
            layer_types=["full_attention"], tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5))
VISION = dict(depth=2, hidden_size=8, intermediate_size=12, num_heads=2, patch_size=2, out_hidden_size=H,
              num_position_embeddings=9)


def _source(vision=VISION, **top):
    hf = dict(architectures=["Qwen3_5ForConditionalGeneration"], text_config=TEXT, vision_config=vision, **top)
    p = "model.language_model."
    t = {f"{p}embed_tokens.weight": (32, H), f"{p}norm.weight": (H,), "lm_head.weight": (32, H)}
    a = f"{p}layers.0."
    t.update({f"{a}input_layernorm.weight": (H,), f"{a}post_attention_layernorm.weight": (H,),
              f"{a}self_attn.q_proj.weight": (16, H), f"{a}self_attn.k_proj.weight": (4, H),
              f"{a}self_attn.v_proj.weight": (4, H), f"{a}self_attn.o_proj.weight": (H, 8),
              f"{a}self_attn.q_norm.weight": (4,), f"{a}self_attn.k_norm.weight": (4,),
              f"{a}mlp.gate_proj.weight": (6, H), f"{a}mlp.up_proj.weight": (6, H), f"{a}mlp.down_proj.weight": (H, 6)})
    return hf, t


def _tower(vision=VISION) -> dict[str, tuple[int, ...]]:
    hf, _ = _source(vision)
    from ninfer_qwen3_5.vision.config import compact_vision_config

    cfg = VisionConfig.from_compact(compact_vision_config(hf, H, False))
    return {source_name(n): s for n, s in vision_shapes(cfg).items()}


def _plan(hf, shapes):
    tensors = {n: SourceTensor(n, s, "F32") for n, s in shapes.items()}
    return Qwen35SourceMapping().plan(hf, tensors)


def test_every_tower_tensor_is_bound_whole_in_its_own_vision_object():
    hf, text = _source(image_token_id=30, video_token_id=31)
    tower = _tower()
    assert len(tower) == 9 + 2 * 12
    plan = _plan(hf, {**text, **tower})
    vision_objects = [o for o in plan.objects if o.component == "vision"]
    assert len(vision_objects) == len(tower)
    comps = {c.id: c for c in plan.components}
    cfg = comps["vision"].config
    assert cfg["image_token_id"] == 30 and cfg["video_token_id"] == 31 and cfg["spatial_merge_size"] == 2
    assert comps["text"].config["vision_config"] == cfg
    specs = parameter_specs(comps["text"].config, StartupFeatures(vision=True))
    bound = {b.name for b in plan.bindings}
    assert {s.name for s in specs if s.component == "vision"} <= bound


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.visual.blocks.1.attn.qkv.bias"), "model.visual.blocks.1.attn.qkv.bias' is missing"),
    (lambda t: t.update({"model.visual.blocks.2.norm1.weight": (8,)}), "not part of a Qwen3.5 tower"),
    (lambda t: t.update({"model.visual.merger.linear_fc1.weight": (32, 16)}), "has shape (32, 16)"),
])
def test_a_tower_that_does_not_match_its_config_is_refused_naming_the_tensor(change, message):
    hf, text = _source()
    tower = _tower()
    change(tower)
    with pytest.raises(Qwen35ConfigError, match=__import__("re").escape(message)):
        _plan(hf, {**text, **tower})


@pytest.mark.parametrize("over, error, message", [
    (dict(out_hidden_size=16), Qwen35ConfigError, "must equal the text hidden_size 8"),
    (dict(hidden_act="silu"), NotSupportedError, "hidden_act 'silu'"),
    (dict(deepstack_visual_indexes=[1]), NotSupportedError, "no deepstack"),
    (dict(num_position_embeddings=10), Qwen35ConfigError, "not a square grid"),
    (dict(hidden_size=12, num_heads=2), Qwen35ConfigError, "divisible by 4"),
    (dict(patch_size=[2, 2]), Qwen35ConfigError, "patch_size must be an integer"),
])
def test_vision_configs_the_tower_cannot_run_are_refused(over, error, message):
    hf, text = _source({**VISION, **over})
    with pytest.raises(error, match=__import__("re").escape(message)):
        _plan(hf, text | {"model.visual.pos_embed.weight": (9, 8)})


def test_a_text_only_artifact_refuses_vision_but_binds_text():
    hf = dict(TEXT, architectures=["Qwen3_5ForCausalLM"])
    _, text = _source()
    plan = _plan(hf, {n.replace("model.language_model.", "model."): s for n, s in text.items()})
    config = plan.components[0].config
    assert "vision_config" not in config and [c.id for c in plan.components] == ["text"]
    assert parameter_specs(config, StartupFeatures())
    with pytest.raises(NotSupportedError, match="no vision tower"):
        parameter_specs(config, StartupFeatures(vision=True))
