"""Fixtures of the causal-scoring tests: tiny random Qwen3.5 checkpoints (dense and MoE) built with
transformers, with a byte-level tokenizer, converted with ninfer.conversion.

Each model is built once per session. Its HF twin (the same weights, fp32, CPU) is the oracle.
``max_position_embeddings`` is small (96) so "context beyond the model's positions" is cheap to test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from support.fixtures import single_torch_thread  # noqa: F401 (autouse for this package)
from support.models import tiny_text_model, write_byte_tokenizer

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


def _build(root: Path, kind: str) -> ScoringModel:
    from ninfer.conversion import convert

    model = tiny_text_model(kind, KINDS[kind], seed=11 if kind == "dense" else 12, eos_token_id=258)
    folder = root / kind
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
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


def start_scorer(artifact, **options):
    """A causal-scoring engine on the CPU in fp32 (the oracle setting)."""
    from ninfer import Engine

    options.setdefault("max_context", 16)
    options.setdefault("page_size", 4)
    options.setdefault("prefill_chunk_size", 5)
    return Engine.start(artifact, device="cpu", dtype="float32", purpose="causal_scoring", **options)
