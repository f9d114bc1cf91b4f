"""The Qwen3.5 compact config and source mapping, checked on the plan alone (no tensor data).

The artifact-level checks (converted files, what loading reads) are in test_qwen35_artifact.py.
"""

from __future__ import annotations

import re

import pytest
from ninfer.artifact.errors import MissingComponentError
from ninfer.artifact.source_mapping import Part, SourceRows, SourceTensor, source_name
from ninfer.contracts.features import StartupFeatures
from ninfer.errors import NotSupportedError
from ninfer.plugins import get_registry
from ninfer_qwen3_5.config import Qwen35Config, Qwen35ConfigError, compact_text_config
from ninfer_qwen3_5.mapping import Qwen35SourceMapping
from ninfer_qwen3_5.parameters import parameter_specs

H, V, NQ, NKV, D, HK, HV, DK, DV, K, I, E, IE, IS = 8, 32, 2, 1, 4, 1, 2, 4, 4, 3, 6, 4, 3, 5  # noqa: E741
C = 2 * HK * DK + HV * DV


def _text_config(moe=False, **over):
    cfg = dict(architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"], vocab_size=V,
               hidden_size=H, num_hidden_layers=2, num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=D,
               linear_conv_kernel_dim=K, linear_key_head_dim=DK, linear_value_head_dim=DV,
               linear_num_key_heads=HK, linear_num_value_heads=HV, rms_norm_eps=1e-6,
               rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5),
               layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False, eos_token_id=7)
    if moe:
        cfg.update(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=IE, shared_expert_intermediate_size=IS)
    else:
        cfg["intermediate_size"] = I
    cfg.update(over)
    return cfg


def _tensors(prefix="model.", moe=False, split_experts=False, tied=False):
    t = {f"{prefix}embed_tokens.weight": (V, H), f"{prefix}norm.weight": (H,)}
    if not tied:
        t["lm_head.weight"] = (V, H)
    for i in range(2):
        p = f"{prefix}layers.{i}."
        t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = (H,)
        if i == 0:
            g = p + "linear_attn."
            t.update({g + "in_proj_qkv.weight": (C, H), g + "in_proj_z.weight": (HV * DV, H),
                      g + "in_proj_b.weight": (HV, H), g + "in_proj_a.weight": (HV, H),
                      g + "conv1d.weight": (C, 1, K), g + "dt_bias": (HV,), g + "A_log": (HV,),
                      g + "norm.weight": (DV,), g + "out_proj.weight": (H, HV * DV)})
        else:
            a = p + "self_attn."
            t.update({a + "q_proj.weight": (2 * NQ * D, H), a + "k_proj.weight": (NKV * D, H),
                      a + "v_proj.weight": (NKV * D, H), a + "o_proj.weight": (H, NQ * D),
                      a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
        m = p + "mlp."
        if not moe:
            t.update({m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H), m + "down_proj.weight": (H, I)})
            continue
        t.update({m + "gate.weight": (E, H), m + "shared_expert.gate_proj.weight": (IS, H),
                  m + "shared_expert.up_proj.weight": (IS, H), m + "shared_expert.down_proj.weight": (H, IS),
                  m + "shared_expert_gate.weight": (1, H)})
        if split_experts:
            for e in range(E):
                t.update({f"{m}experts.{e}.gate_proj.weight": (IE, H), f"{m}experts.{e}.up_proj.weight": (IE, H),
                          f"{m}experts.{e}.down_proj.weight": (H, IE)})
        else:
            t.update({m + "experts.gate_up_proj": (E, 2 * IE, H), m + "experts.down_proj": (E, H, IE)})
    return {n: SourceTensor(n, s, "BF16") for n, s in t.items()}


def _plan(config, tensors):
    plan = Qwen35SourceMapping().plan(config, tensors)
    return plan, {b.name: b for b in plan.bindings}, {o.id: o for o in plan.objects}


def test_registered_for_all_four_source_architectures_and_two_runtime_architectures():
    reg = get_registry()
    assert {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration"} <= set(reg.source_mappings)
    assert {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"} <= set(reg.architectures)
    assert reg.architecture("Qwen3_5MoeForCausalLM").family == "qwen3_5"


def test_every_tensor_is_consumed_and_every_parameter_bound():
    for moe in (False, True):
        cfg = _text_config(moe=moe)
        plan, bindings, objects = _plan(cfg, _tensors(moe=moe))
        whole = [s for o in plan.objects for s in o.sources if not isinstance(s, SourceRows)]
        ranged = {s.name for o in plan.objects for s in o.sources if isinstance(s, SourceRows)}
        assert len(set(whole)) == len(whole) and not set(whole) & ranged
        assert sorted(set(whole) | ranged) == sorted(_tensors(moe=moe))
        compact = plan.components[0].config
        specs = parameter_specs(compact, StartupFeatures())
        assert {s.name for s in specs} == set(bindings)
        for s in specs:  # every binding covers exactly its logical shape
            b = bindings[s.name]
            n = 1
            for x in s.shape:
                n *= x
            covered = sum(p.end - p.begin for p in b.parts) if b.parts else None
            assert covered in (None, n), s.name


def test_fused_gdn_parents_and_row_range_bindings():
    plan, bindings, objects = _plan(_text_config(), _tensors())
    inp = objects["text/layers/0/gdn/in_proj"]
    assert inp.sources == tuple(f"model.layers.0.linear_attn.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a"))
    assert bindings["text/layers/0/gdn/qkv"].parts == (Part(inp.id, 0, C * H),)
    assert bindings["text/layers/0/gdn/z"].parts == (Part(inp.id, C * H, (C + HV * DV) * H),)
    zb = (C + HV * DV) * H
    assert bindings["text/layers/0/gdn/b"].parts == (Part(inp.id, zb, zb + HV * H),)
    assert bindings["text/layers/0/gdn/a"].parts == (Part(inp.id, zb + HV * H, zb + 2 * HV * H),)
    assert bindings["text/layers/0/gdn/conv"].parts == (Part("text/layers/0/gdn/conv", 0, C * K),)


def test_attention_inputs_are_one_parent_with_query_and_gate_deinterleaved():
    _, bindings, objects = _plan(_text_config(), _tensors())
    inp = objects["text/layers/1/attention/in_proj"]
    a = "model.layers.1.self_attn."
    q = a + "q_proj.weight"
    # q_proj rows per head h: [2hD, 2hD + D) query, [2hD + D, 2hD + 2D) gate (HF chunks per head).
    assert inp.sources == (SourceRows(q, 0, D), SourceRows(q, 2 * D, 3 * D), a + "k_proj.weight",
                           a + "v_proj.weight", SourceRows(q, D, 2 * D), SourceRows(q, 3 * D, 4 * D))
    qd, kd = NQ * D * H, NKV * D * H  # elements
    expect = {"query": (0, qd), "key": (qd, qd + kd), "value": (qd + kd, qd + 2 * kd),
              "gate": (qd + 2 * kd, 2 * qd + 2 * kd)}
    for which, (begin, end) in expect.items():
        assert bindings[f"text/layers/1/attention/{which}"].parts == (Part(inp.id, begin, end),), which
    assert {source_name(s) for s in inp.sources} == {q, a + "k_proj.weight", a + "v_proj.weight"}


def test_tied_embedding_is_one_object_bound_twice_with_two_uses():
    cfg = _text_config(tie_word_embeddings=True)
    plan, bindings, objects = _plan(cfg, _tensors(tied=True))
    assert bindings["text/embed"].object == bindings["text/lm_head"].object == "text/embed"
    assert "text/lm_head" not in objects
    uses = {(u.parameter, u.input) for u in plan.uses}
    assert {("text/embed", "text/input_ids"), ("text/lm_head", "text/final_hidden")} <= uses
    # An exported lm_head beside tie_word_embeddings=true is dropped, with the reason recorded.
    plan, _, _ = _plan(cfg, _tensors(tied=False))
    assert "lm_head.weight" in plan.ignored


def test_expert_banks_fused_or_split_give_the_same_bank_layout():
    _, fused, fobj = _plan(_text_config(moe=True), _tensors(moe=True))
    _, split, sobj = _plan(_text_config(moe=True), _tensors(moe=True, split_experts=True))
    assert fused["text/layers/0/moe/experts/gate_up"].object == "text/layers/0/moe/experts/gate_up"
    srcs = sobj["text/layers/0/moe/experts/gate_up"].sources
    assert srcs[:3] == ("model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight",
                        "model.layers.0.mlp.experts.1.gate_proj.weight")
    assert split["text/layers/0/moe/experts/gate_up"].parts == (Part("text/layers/0/moe/experts/gate_up", 0, E * 2 * IE * H),)


def test_conditional_generation_nesting_vision_and_mtp_components():
    text = _text_config()
    text.pop("architectures")
    text.update(mtp_num_hidden_layers=1, tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=4, intermediate_size=6, num_heads=1, patch_size=2, out_hidden_size=H,
                  num_position_embeddings=4, model_type="qwen3_5_vision")
    hf = dict(architectures=["Qwen3_5ForConditionalGeneration"], text_config=text, tie_word_embeddings=True,
              vision_config=vision, image_token_id=99)
    tensors = _tensors(prefix="model.language_model.", tied=True)
    extra = {"model.visual.patch_embed.proj.weight": (4, 3, 2, 2, 2), "model.visual.patch_embed.proj.bias": (4,),
             "model.visual.pos_embed.weight": (4, 4), "model.visual.merger.norm.weight": (4,),
             "model.visual.merger.norm.bias": (4,), "model.visual.merger.linear_fc1.weight": (16, 16),
             "model.visual.merger.linear_fc1.bias": (16,), "model.visual.merger.linear_fc2.weight": (H, 16),
             "model.visual.merger.linear_fc2.bias": (H,),
             **{f"model.visual.blocks.0.{m}.{p}": s for m, shapes in (
                 ("norm1", {"weight": (4,), "bias": (4,)}), ("norm2", {"weight": (4,), "bias": (4,)}),
                 ("attn.qkv", {"weight": (12, 4), "bias": (12,)}), ("attn.proj", {"weight": (4, 4), "bias": (4,)}),
                 ("mlp.linear_fc1", {"weight": (6, 4), "bias": (6,)}),
                 ("mlp.linear_fc2", {"weight": (4, 6), "bias": (4,)})) for p, s in shapes.items()},
             "mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
             "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    layer = {n.replace("model.language_model.layers.1.", "mtp.layers.0."): t.shape
             for n, t in tensors.items() if n.startswith("model.language_model.layers.1.")}
    tensors.update({n: SourceTensor(n, s, "BF16") for n, s in {**extra, **layer}.items()})
    plan, bindings, objects = _plan(hf, tensors)
    comps = {c.id: c for c in plan.components}
    assert comps["text"].config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert comps["text"].config["tie_word_embeddings"] is True      # the composite config decides
    assert comps["vision"].target == comps["mtp"].target == "text"
    assert comps["vision"].config["image_token_id"] == 99 and comps["vision"].config["depth"] == 1
    assert comps["text"].config["vision_config"] == comps["vision"].config   # what parameter_specs reads
    specs = {s.name: s for s in parameter_specs(comps["text"].config, StartupFeatures(vision=True))}
    assert specs["vision/patch_embed/proj/weight"].shape == (4, 3, 2, 2, 2)
    assert specs["vision/blocks/0/attn/qkv/weight"].component == "vision"
    assert {n for n in specs if n.startswith("vision/")} == {b for b in bindings if b.startswith("vision/")}
    for o in plan.objects:
        src = source_name(o.sources[0])
        want = "vision" if src.startswith("model.visual.") else "mtp" if src.startswith("mtp.") else "text"
        assert o.component == want, o.id
    assert "mtp/layers/0/attention/query" in bindings and "mtp/fc" in bindings
    assert not any(o.component == "text" and source_name(o.sources[0]).startswith(("mtp.", "model.visual."))
                   for o in plan.objects)


def test_unknown_or_misshapen_tensors_are_errors_naming_them():
    tensors = _tensors()
    tensors["model.layers.0.something_new.weight"] = SourceTensor("model.layers.0.something_new.weight", (H,), "BF16")
    with pytest.raises(Qwen35ConfigError, match="something_new"):
        Qwen35SourceMapping().plan(_text_config(), tensors)
    tensors = _tensors()
    tensors["model.layers.0.linear_attn.in_proj_z.weight"] = SourceTensor("model.layers.0.linear_attn.in_proj_z.weight",
                                                                          (HV * DV + 1, H), "BF16")
    with pytest.raises(Qwen35ConfigError, match="in_proj_z"):
        Qwen35SourceMapping().plan(_text_config(), tensors)
    with pytest.raises(Qwen35ConfigError, match="lm_head"):
        Qwen35SourceMapping().plan(_text_config(), _tensors(tied=True))


def test_compact_config_expands_layer_types_and_keeps_instance_fields():
    src = _text_config(num_hidden_layers=6, full_attention_interval=3, layer_types=None)
    out = compact_text_config(src)
    assert out["layer_types"] == ["linear_attention", "linear_attention", "full_attention"] * 2
    assert out["eos_token_id"] == 7 and out["rope_parameters"]["rope_theta"] == 1e7
    cfg = Qwen35Config.from_compact(out)
    assert (cfg.rotary_dim, cfg.conv_dim, cfg.attention_layers) == (2, C, (2, 5))
    moe_text = _text_config(moe=True)
    moe_text.pop("architectures")
    moe_text["tie_word_embeddings"] = True
    nested = compact_text_config({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": moe_text})
    assert nested["architectures"] == ["Qwen3_5MoeForCausalLM"] and nested["num_experts"] == E
    assert nested["tie_word_embeddings"] is False                   # composite default, not text_config's
    # Pre-v5 spelling: rope settings at top level, mrope in rope_scaling.
    legacy = _text_config(rope_parameters=None, rope_theta=5e6, partial_rotary_factor=0.5,
                          rope_scaling={"type": "mrope", "mrope_section": [1, 0, 0]})
    rope = compact_text_config(legacy)["rope_parameters"]
    assert rope["rope_theta"] == 5e6 and rope["mrope_section"] == [1, 0, 0]


@pytest.mark.parametrize("over, error", [
    (dict(head_dim=None), Qwen35ConfigError),
    (dict(layer_types=["linear_attention"]), Qwen35ConfigError),
    (dict(layer_types=["linear_attention", "sliding_attention"]), NotSupportedError),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0)), NotSupportedError),
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), Qwen35ConfigError),
    (dict(attention_bias=True), NotSupportedError),
    (dict(hidden_act="gelu"), NotSupportedError),
])
def test_bad_configs_are_refused(over, error):
    with pytest.raises(error):
        compact_text_config(_text_config(**over))


@pytest.mark.parametrize("over, field", [
    (dict(num_key_value_heads=0), "num_key_value_heads must be an integer >= 1, got 0"),
    (dict(linear_num_key_heads=0), "linear_num_key_heads must be an integer >= 1"),
    (dict(hidden_size="x"), "hidden_size must be an integer >= 1, got 'x'"),
    (dict(vocab_size=[1, 2]), "vocab_size must be an integer >= 1"),
    (dict(num_hidden_layers=True), "num_hidden_layers must be an integer >= 1"),
    (dict(rope_parameters=""), "rope_parameters must be an object"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=0)), "rope_theta must be > 0"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=2)),
     "partial_rotary_factor must be in"),
    (dict(layer_types=[[], []]), "layer_types must be a list of strings"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be > 0"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be a boolean (true or false), got 'false'"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25,
                               mrope_interleaved="no")), "mrope_interleaved must be a boolean"),
])
def test_corrupt_config_values_are_refused_naming_the_field(over, field):
    """Wrong types and impossible values, as a hand-edited config.json or a corrupt artifact header holds them: a
    Qwen35ConfigError naming the field (were ZeroDivisionError, ValueError, AttributeError, TypeError), from the
    converter's path and from the stored-config parser alike."""
    with pytest.raises(Qwen35ConfigError, match=re.escape(field)):
        compact_text_config(_text_config(**over))
    stored = compact_text_config(_text_config())
    stored.update(over)
    with pytest.raises(Qwen35ConfigError, match=re.escape(field)):
        Qwen35Config.from_compact(stored)


def test_features_beyond_text_are_refused_until_supported():
    compact = compact_text_config(_text_config())
    # A text-only artifact has no tower: vision is refused saying so.
    with pytest.raises(NotSupportedError, match="has no vision tower"):
        parameter_specs(compact, StartupFeatures(vision=True))
    with pytest.raises(NotSupportedError, match="vision with speculative decoding"):
        parameter_specs(compact, StartupFeatures(vision=True, speculative="mtp"))
    with pytest.raises(NotSupportedError, match="'eagle' is not supported"):
        parameter_specs(compact, StartupFeatures(speculative="eagle"))
    # dflash is supported; a text config converted without a drafter names the missing component.
    with pytest.raises(MissingComponentError, match="needs the artifact component 'dflash'"):
        parameter_specs(compact, StartupFeatures(speculative="dflash"))


def test_speculative_mtp_adds_the_mtp_component():
    compact = compact_text_config(_text_config())
    text = parameter_specs(compact, StartupFeatures())
    both = parameter_specs(compact, StartupFeatures(speculative="mtp"))
    assert both[:len(text)] == text
    mtp = both[len(text):]
    assert mtp and all(s.component == "mtp" and s.name.startswith("mtp/") for s in mtp)
    assert {"mtp/fc", "mtp/norm", "mtp/layers/0/attention/query"} <= {s.name for s in mtp}
