"""Artifacts of the startup tests: besides the suite-wide ``default_artifact`` (the embedded default model:
bf16, tied, dense), a tiny random Qwen3.5-MoE (fp32, untied) built with transformers and converted."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_moe_artifact(tmp_path_factory) -> Path:
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from ninfer.conversion import convert

    root = tmp_path_factory.mktemp("tiny_moe")
    cfg = tf.Qwen3_5MoeTextConfig(
        vocab_size=160, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, max_position_embeddings=256,
        tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(0)
    tf.Qwen3_5MoeForCausalLM(cfg).to(torch.float32).save_pretrained(root / "hf")
    out = root / "tiny_moe.ninfer"
    convert(root / "hf", out, progress=False)
    return out
