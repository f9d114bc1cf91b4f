"""``ninfer-convert TARGET OUT --draft DRAFT_DIR``: a z-lab DFlash / DFlash2 drafter becomes the ``dflash`` component.

A tiny random drafter of each generation (``support.dflash``) round-trips: every stored parameter equals its
source tensor (``mlp/gate_up`` the gate rows then the up rows), the component and the text config carry the
compact drafter config, provenance records the draft folder. A drafter that does not fit its target (hidden size,
vocabulary, target layer ids, a missing or stray tensor) is refused with an error naming the mismatch, and a
target whose mapping takes no draft is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.conversion import convert
from ninfer.conversion.errors import PlanError
from ninfer.errors import NInferError, NotSupportedError
from ninfer_convert.cli import main
from ninfer_qwen3_5.dflash.config import DFlashConfig, DFlashConfigError
from ninfer_qwen3_5.dflash.parameters import dflash_parameter_specs, drafter_config
from ninfer_qwen3_5.profile import summarize_config
from support.dflash import drafter_config as hf_drafter_config
from support.dflash import drafter_tensors, write_dflash_drafter
from support.models import tiny_text_model

from .harness import GEOMETRY

TEXT = dict(GEOMETRY, num_hidden_layers=4, intermediate_size=96, tie_word_embeddings=False)
DRAFT = dict(hidden_size=64, vocab_size=512, num_target_layers=4, target_layer_ids=[0, 2], block_size=8,
             mask_token_id=500, head_dim=8)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dflash_target") / "hf"
    tiny_text_model("dense", TEXT, seed=3).save_pretrained(folder)
    return folder


def _convert(target: Path, draft: Path, out: Path) -> Path:
    return convert(target, out, progress=False, draft=draft).paths[0]


@pytest.mark.parametrize("generation", [1, 2])
def test_a_random_drafter_round_trips(target, tmp_path, generation):
    kw = dict(DRAFT, generation=generation, sliding_window=64 if generation == 2 else None)
    draft = write_dflash_drafter(tmp_path / "draft", seed=4, **kw)
    source = drafter_tensors(hf_drafter_config(**kw), seed=4)
    entry = _convert(target, draft, tmp_path / "m.ninfer")
    with ArtifactReader.open(entry) as reader:
        comp = reader.component("dflash")
        text = reader.component("text").config
        cfg = DFlashConfig.from_compact(comp.config)
        assert comp.target == "text" and text["dflash"] == comp.config
        assert drafter_config(text) == cfg
        assert summarize_config(text)["dflash"] == f"{cfg.architecture}, 2 layers, block 8, target layers [0, 2]"
        assert cfg.generation == generation and cfg.block_size == 8 and cfg.mask_token_id == 500
        assert cfg.target_layer_ids == (0, 2) and cfg.head_dim == 8
        assert cfg.causal == (False, False)   # DFlash2's config says is_causal: false; full layers are non-causal
        assert cfg.sliding_window == ((64, 64) if generation == 2 else (None, None))
        weights = load_weights(reader, dflash_parameter_specs(cfg), "cpu")
        prov = reader.directory.provenance["draft"]
    assert prov["folder"] == "draft" and prov["architecture"] == cfg.architecture
    assert {f["name"] for f in prov["files"]} == {"config.json", "model.safetensors"}
    renamed = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
               "attention/query": "self_attn.q_proj.weight", "attention/key": "self_attn.k_proj.weight",
               "attention/value": "self_attn.v_proj.weight", "attention/out": "self_attn.o_proj.weight",
               "attention/q_norm": "self_attn.q_norm.weight", "attention/k_norm": "self_attn.k_norm.weight",
               "mlp/down": "mlp.down_proj.weight", "attention_conv/base": "attention_conv.base_kernel",
               "attention_conv/projection": "attention_conv.kernel_projection.weight",
               "mlp_conv/base": "mlp_conv.base_kernel", "mlp_conv/projection": "mlp_conv.kernel_projection.weight"}
    top = {"dflash/fc": "fc.weight", "dflash/hidden_norm": "hidden_norm.weight", "dflash/norm": "norm.weight",
           "dflash/selector/predecessor": "candidate_selector.predecessor_codebook",
           "dflash/selector/successor": "candidate_selector.successor_codebook",
           "dflash/selector/hidden": "candidate_selector.hidden_projection.weight"}
    used = set()
    for name, w in weights.items():
        if name in top:
            sources = [top[name]]
        else:
            i, suffix = name[len("dflash/layers/"):].split("/", 1)
            sources = ([f"layers.{i}.mlp.gate_proj.weight", f"layers.{i}.mlp.up_proj.weight"]
                       if suffix == "mlp/gate_up" else [f"layers.{i}.{renamed[suffix]}"])
        used.update(sources)
        assert torch.equal(w, torch.cat([source[n] for n in sources])), name
    assert used == set(source)   # every source tensor is stored, once


def test_the_cli_adds_the_draft(target, tmp_path, capsys):
    draft = write_dflash_drafter(tmp_path / "draft", seed=5, generation=1, **DRAFT)
    out = tmp_path / "m.ninfer"
    assert main([str(target), str(out), "--draft", str(draft), "--quiet"]) == 0
    with ArtifactReader.open(out) as reader:
        assert "dflash" in reader.directory.components


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=32), "hidden_size 32 does not match the target's 64"),
    (dict(vocab_size=256, mask_token_id=3), "vocab_size 256 does not match the target's 512"),
    (dict(target_layer_ids=[0, 7]), "name layer(s) [7] of a target with 4 layers"),
    (dict(num_target_layers=36), "made for a target of 36 layers; this target has 4"),
    (dict(mask_token_id=512), "mask_token_id 512 is outside the target's vocabulary of 512"),
])
def test_a_drafter_that_does_not_fit_is_refused(target, tmp_path, change, message):
    kw = {**DRAFT, "generation": 2, **change}
    draft = write_dflash_drafter(tmp_path / "draft", seed=6, conv_group=8, **kw)
    out = tmp_path / "m.ninfer"
    with pytest.raises(DFlashConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        _convert(target, draft, out)
    assert not out.exists()


def test_reading_the_last_target_layer_is_not_supported(target, tmp_path):
    draft = write_dflash_drafter(tmp_path / "draft", seed=6, generation=1, **{**DRAFT, "target_layer_ids": [1, 3]})
    with pytest.raises(NotSupportedError, match="last layer"):
        _convert(target, draft, tmp_path / "m.ninfer")


def test_missing_and_stray_tensors_are_named(target, tmp_path):
    cfg = hf_drafter_config(generation=1, **DRAFT)
    tensors = drafter_tensors(cfg, seed=7)
    missing = dict(tensors)
    del missing["layers.1.self_attn.k_norm.weight"]
    draft = write_dflash_drafter(tmp_path / "a", tensors=missing, generation=1, **DRAFT)
    with pytest.raises(DFlashConfigError, match="lacks tensor 'layers.1.self_attn.k_norm.weight'"):
        _convert(target, draft, tmp_path / "a.ninfer")
    stray = {**tensors, "lm_head.weight": torch.zeros(512, 64)}
    draft = write_dflash_drafter(tmp_path / "b", tensors=stray, generation=1, **DRAFT)
    with pytest.raises(DFlashConfigError, match="not part of a DFlashDraftModel drafter: lm_head.weight"):
        _convert(target, draft, tmp_path / "b.ninfer")
    bad = {**tensors, "fc.weight": torch.zeros(64, 64)}
    draft = write_dflash_drafter(tmp_path / "c", tensors=bad, generation=1, **DRAFT)
    with pytest.raises(DFlashConfigError, match=r"'fc.weight' has shape \(64, 64\), the config implies \(64, 128\)"):
        _convert(target, draft, tmp_path / "c.ninfer")


def test_config_errors_name_the_field(tmp_path):
    cfg = hf_drafter_config(generation=2, **DRAFT)
    del cfg["dflash_config"]["mask_token_id"]
    from ninfer_qwen3_5.dflash.config import compact_dflash_config

    with pytest.raises(DFlashConfigError, match="has no 'mask_token_id'"):
        compact_dflash_config(cfg)
    with pytest.raises(NotSupportedError, match="attention biases"):
        compact_dflash_config({**hf_drafter_config(generation=1, **DRAFT), "attention_bias": True})
    with pytest.raises(DFlashConfigError, match="is not one of"):
        compact_dflash_config({**hf_drafter_config(generation=1, **DRAFT), "architectures": ["Qwen3ForCausalLM"]})
    v1 = hf_drafter_config(generation=1, sliding_window=32, **DRAFT)
    assert compact_dflash_config(v1)["causal"] == [True, True]   # first generation: sliding layers are causal
    no_ids = hf_drafter_config(generation=1, layers=5, **{**DRAFT, "num_target_layers": 36})
    del no_ids["dflash_config"]["target_layer_ids"]
    assert compact_dflash_config(no_ids)["target_layer_ids"] == [1, 9, 17, 25, 33]


def test_a_target_mapping_without_drafts_refuses_one(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "convert"))
    import convert_synth_arch
    from convert_synth_ckpt import synth_tensors, write_checkpoint
    from ninfer.plugins import PluginRegistry

    registry = PluginRegistry(load_entry_points=False, extra_plugins=(convert_synth_arch,))
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    draft = write_dflash_drafter(tmp_path / "draft", generation=1, **DRAFT)
    with pytest.raises(PlanError, match="takes no draft checkpoint"):
        convert(src, tmp_path / "m.ninfer", registry=registry, progress=False, draft=draft)


def test_drafter_config_without_a_draft_says_how_to_add_one():
    with pytest.raises(NInferError, match="--draft"):
        drafter_config({"architectures": ["Qwen3_5ForCausalLM"]})
    assert json.dumps(hf_drafter_config(generation=2, **DRAFT))  # plain JSON
