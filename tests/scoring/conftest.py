"""Fixtures of the causal-scoring tests: tiny random Qwen3.5 checkpoints (dense and MoE) built with
transformers, with a byte-level tokenizer, converted with ninfer_convert.

Each model is built once per session. Its HF twin (the same weights, fp32, CPU) is the oracle.
``max_position_embeddings`` is small (96) so "context beyond the model's positions" is cheap to test.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.modules.setdefault("fla", None)            # transformers' torch GDN path (the oracle)
sys.modules.setdefault("causal_conv1d", None)

MAX_POSITIONS = 96
VOCAB = 272  # 256 byte tokens, 3 specials, 4 added tokens, 9 unused ids
GEOMETRY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=MAX_POSITIONS,
                tie_word_embeddings=False)
KINDS = {"dense": dict(GEOMETRY, intermediate_size=96),
         "moe": dict(GEOMETRY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48)}


@dataclass(frozen=True)
class ScoringModel:
    kind: str
    artifact: Path
    hf: object  # transformers model, fp32, eval mode


def _write_tokenizer(folder: Path) -> None:
    """Byte-level BPE with no merges: one token per byte (ids 0..255), then the Qwen specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(s, special=False, normalized=False)
                    for s in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                              "pad_token": "<|endoftext|>"}))


def _randomize(model, seed: int) -> None:
    """O(1) logits: matrices N(0, 1/fan_in), zero-centred norm weights U(-0.5, 0.5), the GDN output
    norm U(0.5, 1.5), decay parameters in a well-conditioned range (A_log = log U(0.1, 2))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.1, 2.0, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif p.ndim == 1:
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _build(root: Path, kind: str) -> ScoringModel:
    import torch
    import transformers as tf
    from ninfer_convert.convert import convert

    if kind == "dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**KINDS[kind], eos_token_id=258))
    else:
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**KINDS[kind], eos_token_id=258))
    _randomize(model, seed=11 if kind == "dense" else 12)
    model = model.to(torch.float32).eval()
    folder = root / kind
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    artifact = root / f"{kind}.ninfer"
    convert(folder, artifact, progress=False)
    return ScoringModel(kind=kind, artifact=artifact, hf=model)


@pytest.fixture(scope="session")
def scoring_model(tmp_path_factory):
    """``scoring_model(kind)`` -> :class:`ScoringModel`, built once per session."""
    root = tmp_path_factory.mktemp("scoring")
    built: dict[str, ScoringModel] = {}

    def get(kind: str = "dense") -> ScoringModel:
        if kind not in built:
            built[kind] = _build(root, kind)
        return built[kind]

    return get


@pytest.fixture(autouse=True, scope="package")
def single_torch_thread():
    """Tiny models on a small shared machine: intra-op threads only add spinning."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def start_scorer(artifact, **options):
    """A causal-scoring engine on the CPU in fp32 (the oracle setting)."""
    from ninfer import Engine

    options.setdefault("max_context", 16)
    options.setdefault("page_size", 4)
    options.setdefault("prefill_chunk_size", 5)
    return Engine.start(artifact, device="cpu", dtype="float32", purpose="causal_scoring", **options)
