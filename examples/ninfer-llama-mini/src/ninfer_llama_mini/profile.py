"""The ModelProfile (the planner's sizes, known before any weight is read) and ``ninfer info``'s summary.

The exact fields equal what :class:`~ninfer_llama_mini.program.LlamaMiniProgram` allocates for a run dtype
(``ninfer.testing.profiles`` checks it): every parameter in the run dtype (a tied head once) plus the fp32
RoPE inverse frequencies; of those, the casts of parameters stored in another dtype and the inverse
frequencies are created at construction (``converted_weight_bytes``); KV and state bytes come from the same
layout the Program declares. The workspace terms estimate the torch reference path's temporaries; the
compute terms count a multiply-add as two FLOPs.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any

import torch
from ninfer.contracts.architecture import ModelProfile
from ninfer.contracts.features import StartupFeatures

from ninfer_llama_mini.config import LlamaMiniConfig
from ninfer_llama_mini.layout import model_layout
from ninfer_llama_mini.parameters import parameter_specs

_F32 = 4


def profile(config: Mapping[str, Any], features: StartupFeatures, dtype: torch.dtype | None = None,
            stored_dtypes: Mapping[str, torch.dtype] | None = None,
            packed_bytes: Mapping[str, int] | None = None) -> ModelProfile:
    # packed_bytes stays empty: this mapping declares no weight uses, so its artifacts are never quantized.
    cfg = LlamaMiniConfig.from_compact(config)
    run = dtype or torch.bfloat16
    s, stored = run.itemsize, stored_dtypes or {}
    weights = converted = cfg.head_dim // 2 * _F32   # the inverse frequencies
    for spec in parameter_specs(config, features):
        if spec.name == "text/lm_head" and cfg.tie_word_embeddings:
            continue   # the embedding tensor itself
        nbytes = prod(spec.shape) * s
        weights += nbytes
        converted += nbytes if stored.get(spec.name, run) != run else 0
    layout = model_layout(cfg)
    H, I, V, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_heads * D, layout.kv.num_kv_heads * layout.kv.head_dim
    return ModelProfile(
        weight_bytes=weights,
        converted_weight_bytes=converted,
        kv_bytes_per_token=len(layout.kv.layers) * 2 * kv * s,
        state_bytes_per_sequence=layout.state.image_bytes,
        vocab_size=layout.vocab_size,
        max_position_embeddings=layout.max_positions,
        # Residual, normed input, qkv, rotated q and k, attention output (fp32 inside), gate_up and activation;
        # the fp32 rotary angles, cos and sin.
        activation_bytes_per_token=s * (3 * H + 2 * (q + 2 * kv) + 2 * q + 3 * I) + _F32 * (q + 3 * D),
        attention_bytes_per_context_token=2 * kv * (s + _F32),   # the reference gathers K and V, then fp32 copies
        score_bytes_per_query_key=2 * _F32 * cfg.num_heads,      # scores and their softmax, fp32
        matmul_params_per_token=cfg.num_layers * H * (2 * q + 2 * kv + 3 * I),
        head_params=V * H,
        attention_flops_per_query_key=cfg.num_layers * cfg.num_heads * 4 * D,
        embedding_bytes=0 if cfg.tie_word_embeddings else V * H * s)


def summarize_config(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = LlamaMiniConfig.from_compact(config)
    return {"architecture": config["architectures"][0], "layers": cfg.num_layers, "hidden": cfg.hidden_size,
            "attention": f"{cfg.num_heads}q/{cfg.num_kv_heads}kv x {cfg.head_dim}", "mlp": cfg.intermediate_size,
            "vocab": cfg.vocab_size, "tied_embeddings": cfg.tie_word_embeddings,
            "context": cfg.max_position_embeddings}
