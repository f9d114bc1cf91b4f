"""Tiny random Qwen3.5 checkpoints (dense and MoE, fp32, untied head), saved once per session."""

from __future__ import annotations

import pytest
import torch
from support.models import tiny_text_model, write_byte_tokenizer

GEOMETRY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
                num_hidden_layers=4, tie_word_embeddings=False)
KINDS = {
    "dense": ("Qwen3_5ForCausalLM", dict(GEOMETRY, intermediate_size=96)),
    "moe": ("Qwen3_5MoeForCausalLM", dict(GEOMETRY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48)),
}


def _checkpoint(root, kind: str):
    arch, text = KINDS[kind]
    model = tiny_text_model(kind, text, seed=3)
    model.config.architectures = [arch]
    model.config.eos_token_id = 258
    folder = root / kind
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_ckpt")
    torch.manual_seed(0)
    return {kind: _checkpoint(root, kind) for kind in KINDS}
