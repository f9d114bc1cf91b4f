"""Converting Qwen4-Exp checkpoints: the compact config, the source mapping (sharded n-gram tables, fused parents,
what is ignored and why), the composite ``Qwen4ExpForConditionalGeneration`` layout, the hash constants derived from
the config, clear errors for what is not Qwen4-Exp, and the plugin's registration."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from ninfer.artifact import ArtifactReader
from ninfer.conversion import convert
from ninfer.errors import NotSupportedError
from ninfer.testing import CHATML_SPECIALS, write_byte_tokenizer
from ninfer_qwen4exp.config import Qwen4ExpConfig, Qwen4ExpConfigError, compact_text_config
from ninfer_qwen4exp.ple_hash import config_hash

from .harness import CASES, EOS, build_hf


def _hf_config(name: str, **changes) -> dict:
    cfg = dict(CASES[name], **changes)
    cfg["architectures"] = ["Qwen4ExpForCausalLM"]
    return cfg


@pytest.mark.parametrize("name", sorted(CASES))
def test_hash_constants_equal_the_checkpoint_buffers(q4x_case, name):
    case = q4x_case(name)
    cfg = Qwen4ExpConfig.from_compact(case.config)
    for index, layer in enumerate(cfg.ple_layers):
        emb = case.hf.model.layers[layer].ple.ple_embedding
        h = config_hash(cfg, index)
        assert list(h.multipliers) == emb.layer_multipliers.tolist()
        assert list(h.sizes) == emb.ngram_heads_vocab_sizes.tolist()
        assert list(h.offsets) == emb.ngram_heads_offsets.tolist()
        assert h.rows == emb.ngram_embedding.weight.shape[0]


def test_the_real_configs_hash_geometry():
    """The released model's table: 16 heads of primes from 20,000,000, 320,001,536 rows after padding to 128."""
    from ninfer_qwen4exp.ple_hash import ngram_hash

    h = ngram_hash(248320, 3, 8, 20_000_000, 128, 1234, 0)
    assert h.rows == 320_001_536 and len(h.sizes) == 16 and h.sizes[0] == 20_000_003
    assert all(m % 2 == 1 and 248320 * m < 2**63 for m in h.multipliers)


@pytest.mark.parametrize("name", sorted(CASES))
def test_converted_weights_are_the_checkpoints(q4x_case, name):
    """The sharded n-gram tables are concatenated back in shard order; fused parents keep every source row."""
    case = q4x_case(name)
    state = case.hf.state_dict()
    cfg = Qwen4ExpConfig.from_compact(case.config)
    for layer in cfg.ple_layers:
        table = case.weights[f"text/layers/{layer}/ple/table"]
        assert torch.equal(table, state[f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"])
        kv = state[f"model.layers.{layer}.ple.key_proj.weight"], state[f"model.layers.{layer}.ple.value_proj.weight"]
        assert torch.equal(case.weights[f"text/layers/{layer}/ple/key"], kv[0])
        assert torch.equal(case.weights[f"text/layers/{layer}/ple/value"], kv[1])
    for layer in cfg.attention_layers:
        idx = state[f"model.layers.{layer}.self_attn.indexer.index_qk_proj.weight"]
        hd = cfg.indexer_heads * cfg.indexer_head_dim
        assert torch.equal(case.weights[f"text/layers/{layer}/attention/indexer_q"], idx[:hd])
        assert torch.equal(case.weights[f"text/layers/{layer}/attention/indexer_k"], idx[hd:])
    hc = "model.layers.0.attn_hyper_connection."
    assert torch.equal(case.weights["text/layers/0/attn_hc/down"], state[hc + "input_mix_weight_down.weight"])
    assert torch.equal(case.weights["text/layers/0/attn_hc/inject"], state[hc + "block_inject_weight.weight"])


def test_compact_config_normalises_what_the_runtime_reads():
    out = compact_text_config(_hf_config("dense"))
    assert out["architectures"] == ["Qwen4ExpForCausalLM"]
    assert out["layer_types"] == ["linear_attention", "indexed_attention", "linear_attention", "linear_attention",
                                  "indexed_attention"]
    assert out["output_gate_type"] == "silu" and out["eos_token_id"] == EOS
    assert out["rope_parameters"]["partial_rotary_factor"] == 0.5
    # transformers 5.17 and 5.24 spell the attention layers differently; both mean QSA.
    for spelling in ("qwen_sparse_attention", "indexed_attention"):
        types = [spelling if t == "full_attention" else t for t in CASES["dense"]["layer_types"]]
        assert compact_text_config(_hf_config("dense", layer_types=types))["layer_types"] == out["layer_types"]
    # The full_attention_interval default (4) when the list is absent.
    plain = compact_text_config(_hf_config("plain"))
    assert [i for i, t in enumerate(plain["layer_types"]) if t == "indexed_attention"] == [3, 7]
    # An omitted partial rotary factor is 1.0 (transformers' Qwen4-Exp rotary), a list of EOS ids its first.
    rope = {"rope_type": "default", "rope_theta": 1e4}
    out = compact_text_config(_hf_config("sparse", rope_parameters=rope, eos_token_id=[EOS, 256], indexer_head_dim=16))
    assert out["rope_parameters"]["partial_rotary_factor"] == 1.0 and out["eos_token_id"] == EOS


@pytest.mark.parametrize(("changes", "error", "match"), [
    (dict(ple_layer_ids=[4]), NotSupportedError, "PLE on layers \\[4\\]"),
    (dict(ple_layer_ids=[9]), Qwen4ExpConfigError, "one-based layer ids"),
    (dict(eos_token_id=None), Qwen4ExpConfigError, "PLE needs eos_token_id"),
    (dict(indexer_budget=None), Qwen4ExpConfigError, "all-or-nothing"),
    (dict(indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None,
          indexer_compress_ratio=None), Qwen4ExpConfigError, "need the QSA indexer fields"),
    (dict(indexer_kv_heads=2), NotSupportedError, "indexer_kv_heads=2"),
    (dict(indexer_budget=5), Qwen4ExpConfigError, "not a multiple of indexer_compress_ratio"),
    (dict(indexer_head_dim=2), Qwen4ExpConfigError, "exceeds indexer_head_dim"),
    (dict(hc_count=1), Qwen4ExpConfigError, "hc_count must be > 1"),
    (dict(norm_topk_prob=False), NotSupportedError, "norm_topk_prob"),
    (dict(output_gate_type="gelu"), NotSupportedError, "output_gate_type"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), NotSupportedError, "sliding_attention"),
    (dict(num_experts=None), Qwen4ExpConfigError, "has no 'num_experts'"),
    (dict(ple_embed_dim=30), Qwen4ExpConfigError, "ple_embed_dim 30"),
    (dict(tie_word_embeddings="false"), Qwen4ExpConfigError, "tie_word_embeddings must be a boolean"),
])
def test_bad_configs_name_the_field(changes, error, match):
    with pytest.raises(error, match=match):
        compact_text_config(_hf_config("sparse", **changes))


def test_a_stored_config_with_a_string_for_a_boolean_is_refused():
    """A hand-edited artifact's stored config: the string "false" is not False (it would tie the LM head)."""
    from ninfer_qwen4exp.config import Qwen4ExpConfig

    stored = compact_text_config(_hf_config("sparse"))
    stored["tie_word_embeddings"] = "false"
    with pytest.raises(Qwen4ExpConfigError, match="tie_word_embeddings must be a boolean"):
        Qwen4ExpConfig.from_compact(stored)


def test_composite_checkpoint_converts_text_and_stores_the_tower(tmp_path, q4x_case):
    """``Qwen4ExpForConditionalGeneration``: text under ``model.language_model.`` converts to the same weights as
    the causal LM; the vision tower becomes its own component, stored as Qwen3.5-MoE's (the ``mtp`` component:
    test_qwen4exp_mtp_head.py)."""
    import transformers as tf

    text = dict(CASES["sparse"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  num_position_embeddings=16, patch_size=4)
    model = tf.Qwen4ExpForConditionalGeneration(tf.Qwen4ExpConfig(text_config=text, vision_config=vision)).eval()
    causal = q4x_case("sparse").hf
    with torch.no_grad():   # the same text weights as the causal case
        for name, p in model.model.language_model.named_parameters():
            p.copy_(causal.model.get_parameter(name))
        model.lm_head.weight.copy_(causal.lm_head.weight)
    folder = tmp_path / "composite"
    model.save_pretrained(folder)
    write_byte_tokenizer(folder, specials=CHATML_SPECIALS, eos="<|im_end|>")
    convert(folder, tmp_path / "composite.ninfer", progress=False)
    with ArtifactReader.open(tmp_path / "composite.ninfer") as reader:
        assert set(reader.directory.components) == {"text", "vision"}
        text_config = reader.component("text").config
        vision_config = reader.component("vision").config
        # The text config carries the tower's (what parameter_specs, profile and the Program read); the rest of it
        # is the causal LM's.
        assert text_config == {**q4x_case("sparse").config, "vision_config": vision_config}
        assert vision_config["architectures"] == ["Qwen3_5MoeVision"]     # Qwen3.5-MoE's tower
        assert vision_config["out_hidden_size"] == text["hidden_size"] and vision_config["depth"] == 1


def test_plan_ignores_exactly_what_it_derives_or_does_not_run():
    from ninfer.artifact.source_mapping import SourceTensor
    from ninfer_qwen4exp.mapping import Qwen4ExpSourceMapping

    hf = build_hf("sparse", seed=1)
    tensors = {n: SourceTensor(n, tuple(t.shape), "F32") for n, t in hf.state_dict().items()}
    p = "model.layers.1.ple.ple_embedding."
    del tensors[p + "ngram_embedding.weight"]
    rows, width = hf.model.layers[1].ple.ple_embedding.ngram_embedding.weight.shape
    for j, n in enumerate((100, 100, rows - 200)):   # uneven shards, as torch.chunk cuts them
        tensors[f"{p}ngram_embedding.shard_{j}.weight"] = SourceTensor(f"{p}ngram_embedding.shard_{j}.weight",
                                                                       (n, width), "F32")
    tensors[p + "hashstats_bigram"] = SourceTensor(p + "hashstats_bigram", (4,), "F32")
    config = dict(CASES["sparse"], architectures=["Qwen4ExpForCausalLM"])
    plan = Qwen4ExpSourceMapping().plan(config, tensors)
    assert set(plan.ignored) == {p + "layer_multipliers", p + "ngram_heads_vocab_sizes", p + "ngram_heads_offsets",
                                 p + "hashstats_bigram"}
    table = next(o for o in plan.objects if o.id == "text/layers/1/ple/table")
    assert table.sources == tuple(f"{p}ngram_embedding.shard_{j}.weight" for j in range(3))
    tensors[f"{p}ngram_embedding.shard_2.weight"] = SourceTensor(f"{p}ngram_embedding.shard_2.weight",
                                                                 (rows - 199, width), "F32")
    with pytest.raises(Qwen4ExpConfigError, match="hold .* rows; the config implies"):
        Qwen4ExpSourceMapping().plan(config, tensors)
    tensors[f"{p}ngram_embedding.shard_2.weight"] = SourceTensor(f"{p}ngram_embedding.shard_2.weight",
                                                                 (rows - 200, width), "F32")
    tensors["model.layers.0.unknown.weight"] = SourceTensor("model.layers.0.unknown.weight", (2,), "F32")
    with pytest.raises(Qwen4ExpConfigError, match="not part of a Qwen4-Exp model: model.layers.0.unknown.weight"):
        Qwen4ExpSourceMapping().plan(config, tensors)


def test_ninfer_plugins_lists_qwen4exp():
    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "plugins"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    block = out.stdout[out.stdout.index("qwen4exp: ninfer-qwen4exp"):]
    assert "architectures: Qwen4ExpForCausalLM" in block and "source_mappings: qwen4exp" in block
