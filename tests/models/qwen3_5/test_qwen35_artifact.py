"""Converted artifacts: components, what loading Text reads, and the architecture's profile."""

from __future__ import annotations

import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.features import StartupFeatures


def test_vision_and_mtp_are_separate_components_never_read_for_text(qwen_case):
    case = qwen_case("vlm")
    reader = ArtifactReader.open(case.artifact)
    comps = reader.directory.components
    assert set(comps) == {"text", "vision", "mtp"}
    assert comps["text"].config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert comps["vision"].target == "text" and comps["vision"].config["depth"] == 1
    assert comps["mtp"].config["architectures"] == ["Qwen3_5MTP"]
    optional = [o for o in reader.directory.objects if o.id.startswith(("vision/", "mtp/"))]
    assert any(o.id.startswith("vision/") for o in optional) and any(o.id.startswith("mtp/") for o in optional)
    assert "vision/patch_embed/proj/weight" in reader.directory.bindings
    assert "mtp/layers/0/attention/query" in reader.directory.bindings

    reads: list[tuple[int, int]] = []
    inner = reader.read_into

    def recording(offset, buf):
        reads.append((offset, offset + len(buf)))
        return inner(offset, buf)

    reader.read_into = recording
    specs = case.spec.parameter_specs(comps["text"].config, StartupFeatures())
    weights = load_weights(reader, specs, "cpu")
    assert reads, "loading read nothing"
    for o in optional:
        hit = [r for r in reads if r[0] < o.offset + o.bytes and o.offset < r[1]]
        assert not hit, f"loading Text read bytes of {o.id}"
    # Tied: the head is the embedding, read once.
    assert torch.equal(weights["text/lm_head"], weights["text/embed"])
    hf = case.hf.state_dict()
    assert torch.equal(weights["text/embed"], hf["model.language_model.embed_tokens.weight"])
    attn = "model.language_model.layers.3.self_attn."
    q_proj = hf[attn + "q_proj.weight"].view(4, 32, 64)    # 4 heads of [16 query rows; 16 gate rows]
    assert torch.equal(weights["text/layers/3/attention/query"].view(4, 16, 64), q_proj[:, :16])
    assert torch.equal(weights["text/layers/3/attention/gate"].view(4, 16, 64), q_proj[:, 16:])
    assert torch.equal(weights["text/layers/3/attention/key"], hf[attn + "k_proj.weight"])
    assert torch.equal(weights["text/layers/3/attention/value"], hf[attn + "v_proj.weight"])
    # The four are row ranges of one stored parent, loaded as views of one tensor, in [query|key|value|gate] order:
    # the layer runs them as one GEMM (layers/fused.py).
    ws = [weights[f"text/layers/3/attention/{x}"] for x in ("query", "key", "value", "gate")]
    assert len({w.untyped_storage().data_ptr() for w in ws}) == 1
    assert all(a.data_ptr() + a.numel() * a.element_size() == b.data_ptr() for a, b in zip(ws, ws[1:], strict=False))


def test_profile_and_summary_come_from_the_config(qwen_case):
    case = qwen_case("moe")
    prof = case.spec.profile(case.config, StartupFeatures())
    specs = case.spec.parameter_specs(case.config, StartupFeatures())
    # Untied, bf16; the GDN keeps fp32 decay rates and dt_bias, plus fp32 rotary inverse frequencies
    # (rotary dim 16 * 0.25 = 4, two frequencies). tests/startup checks this against allocated tensors.
    fp32 = sum(torch.Size(s.shape).numel() for s in specs if s.name.endswith(("gdn/A_log", "gdn/dt_bias")))
    # The MoE block's fused input weight gets zero rows up to a multiple of 8 (layers/moe.py): E + 2Is + 1 rows.
    cfg = case.config["text"] if "text" in case.config else case.config
    rows = cfg["num_experts"] + 2 * cfg["shared_expert_intermediate_size"] + 1
    pad = cfg["num_hidden_layers"] * (-rows % 8) * cfg["hidden_size"] * 2
    assert pad > 0
    assert prof.weight_bytes == 2 * sum(torch.Size(s.shape).numel() for s in specs) + 2 * fp32 + 2 * 4 + pad
    assert prof.kv_bytes_per_token == 1 * 2 * 2 * 16 * 2                              # 1 attn layer, K+V
    # 3 GDN layers: conv [C=2*32+64, 3] bf16 + recurrent [4, 16, 16] fp32, each field 256-aligned.
    assert prof.state_bytes_per_sequence == 3 * (768 + 4096)
    assert prof.vocab_size == 512
    summary = case.spec.summarize_config(case.config)
    assert summary["moe"].startswith("8 experts top-2") and "3 GDN" in summary["layers"]


def test_moe_fused_input_rows_are_padded_with_zeros(qwen_case):
    """The fused [router; shared gate_up; shared gate] weight has a multiple of 8 rows, the extra ones zero (a
    [T, rows] GEMM output with an aligned row stride), and the block still sees exactly its E + 2Is + 1 columns."""
    from ninfer_qwen3_5.config import Qwen35Config
    from ninfer_qwen3_5.layers.moe import SparseMoE, fused_input_rows

    case = qwen_case("moe")
    cfg = Qwen35Config.from_compact(case.config)
    h, e, s = cfg.hidden_size, cfg.num_experts, cfg.shared_expert_intermediate_size
    g = torch.Generator().manual_seed(0)
    w = {"router": torch.randn(e, h, generator=g), "shared/gate_up": torch.randn(2 * s, h, generator=g),
         "shared/gate": torch.randn(1, h, generator=g), "shared/down": torch.randn(h, s, generator=g),
         "experts/gate_up": torch.randn(e, 2 * cfg.moe_intermediate_size, h, generator=g),
         "experts/down": torch.randn(e, h, cfg.moe_intermediate_size, generator=g)}
    block = SparseMoE(cfg, w, ops=None)
    rows = e + 2 * s + 1
    assert block.w_in.shape == (fused_input_rows(cfg), h) and block.w_in.shape[0] % 8 == 0 and rows % 8
    assert torch.equal(block.w_in[:rows], torch.cat((w["router"], w["shared/gate_up"], w["shared/gate"])))
    assert not block.w_in[rows:].any()
