"""Address-free sizes of a Qwen3.5 instance for the planner (ModelProfile) and ``ninfer info``.

Sizes assume the bf16 activation/weight dtype the engine runs on CUDA (2 bytes per element; the
recurrent state is fp32 whatever the activation dtype). A tied head is counted once.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any

import torch
from ninfer.runtime.contract.architecture import ModelProfile
from ninfer.runtime.contract.features import StartupFeatures

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.parameters import parameter_specs
from ninfer_qwen3_5.state import state_layout

_BF16 = 2


def profile(config: Mapping[str, Any], features: StartupFeatures) -> ModelProfile:
    cfg = Qwen35Config.from_compact(config)
    specs = parameter_specs(config, features)
    elements = sum(prod(s.shape) for s in specs if not (cfg.tie_word_embeddings and s.name == "text/lm_head"))
    return ModelProfile(
        weight_bytes=elements * _BF16,
        kv_bytes_per_token=len(cfg.attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * _BF16,
        state_bytes_per_sequence=state_layout(cfg, torch.bfloat16).image_bytes,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings)


def summarize_config(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = Qwen35Config.from_compact(config)
    out: dict[str, Any] = {
        "architecture": cfg.architecture,
        "layers": f"{cfg.num_layers} ({len(cfg.gdn_layers)} GDN, {len(cfg.attention_layers)} attention)",
        "hidden": cfg.hidden_size,
        "attention": f"{cfg.num_heads}q/{cfg.num_kv_heads}kv x {cfg.head_dim} (rotary {cfg.rotary_dim})",
        "gdn": (f"{cfg.linear_num_key_heads}k/{cfg.linear_num_value_heads}v heads, "
                f"{cfg.linear_key_head_dim}/{cfg.linear_value_head_dim} dims, conv {cfg.conv_kernel}"),
        "vocab": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "context": cfg.max_position_embeddings,
    }
    if cfg.is_moe:
        out["moe"] = (f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}, width "
                      f"{cfg.moe_intermediate_size}, shared {cfg.shared_expert_intermediate_size}")
    else:
        out["mlp"] = cfg.intermediate_size
    return out
