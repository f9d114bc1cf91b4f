"""Address-free sizes of a Qwen4-Exp instance for the planner (ModelProfile) and ``ninfer info``.

Exact figures mirror what :class:`~ninfer_qwen4exp.program.Qwen4ExpProgram` allocates for a run dtype:

- device weights: every text parameter in the run dtype (cast once when stored otherwise), a tied head once, except
  - ``gdn/A_log`` and ``gdn/dt_bias``: fp32 tensors derived from them (as Qwen3.5);
  - the MoE block's router + shared gate_up + shared gate: one new concatenated tensor with zero padding rows
    (as Qwen3.5-MoE);
  - ``ple/conv``: replaced by its dense causal kernel ``[nH, (K-1)*ngram_size + 1]``, made at construction;
  - ``ple/table``: host memory (``host_weight_bytes``), kept in its stored dtype;
  - with host experts, the text layers' routed expert banks: host memory too, as stored; the device then holds
    ``expert_cache_slots`` experts per layer and the copy path's staging buffer, in the run dtype;
  plus the fp32 rotary inverse frequencies and each PLE layer's int64 hash constants (multipliers, head sizes and
  offsets), made at construction.
- KV: per indexed-attention layer, K and V of ``Nkv * D`` and the indexer's side pool (K and V rows of
  ``max(d, 2R)``), run dtype; with ``speculative == "mtp"`` the MTP layer's too, and the weights then include the
  ``mtp`` component's (with the MTP layer's fused MoE input and its own inverse frequencies).
- State: the StateImage of :mod:`ninfer_qwen4exp.state` (with vision the rope delta too).
- Vision (``features.vision``): the tower's parameters in the run dtype and the encoder's workspace per input row,
  as Qwen3.5-MoE's (:func:`ninfer_qwen3_5.profile.encoder_bytes_per_row`).

The workspace terms are estimates of the torch reference path's temporaries; compute terms count a multiply-add
as two FLOPs (the MoE counts its routed top-k).
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any

import torch
from ninfer.contracts.architecture import ModelProfile
from ninfer.contracts.features import StartupFeatures
from ninfer_qwen3_5.layers.host_experts import STAGE_SLOTS
from ninfer_qwen3_5.layers.moe import fused_input_rows
from ninfer_qwen3_5.parameters import layer_prefix
from ninfer_qwen3_5.profile import encoder_bytes_per_row, grouped_moe_blocks, packed_held

from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.parameters import host_expert_layers, parameter_specs
from ninfer_qwen4exp.state import model_layout

_F32, _I64 = 4, 8
_FP32_DERIVED = ("gdn/A_log", "gdn/dt_bias")
_MOE_FUSED_INPUT = ("moe/router", "moe/shared/gate_up", "moe/shared/gate")


def _weights(cfg: Qwen4ExpConfig, config: Mapping[str, Any], features: StartupFeatures, run: torch.dtype,
             stored: Mapping[str, torch.dtype], packed: Mapping[str, int]) -> tuple[int, int, int]:
    """(device-resident bytes, bytes created at construction, host-resident bytes)."""
    resident = converted = host = 0
    taps = (cfg.ple_conv_kernel - 1) * cfg.ngram_size + 1
    grouped = grouped_moe_blocks(packed)
    for s in parameter_specs(config, features):
        if cfg.tie_word_embeddings and s.name == "text/lm_head":
            continue
        if (held_packed := packed_held(s, packed)) is not None:
            resident, host = resident + held_packed[0], host + held_packed[1]
            continue
        held = stored.get(s.name, run)
        if s.placement == "host":   # PLE tables and host expert banks are kept as stored
            host += prod(s.shape) * held.itemsize
            continue
        if s.name.endswith(_FP32_DERIVED):
            nbytes = prod(s.shape) * _F32
            new = s.name.endswith("gdn/A_log") or held != torch.float32
        elif s.name.endswith("ple/conv"):
            nbytes, new = s.shape[0] * taps * run.itemsize, True
        else:
            fused = s.name.endswith(_MOE_FUSED_INPUT) and s.name.rsplit("/moe/", 1)[0] not in grouped
            nbytes, new = prod(s.shape) * run.itemsize, held != run or fused
        resident += nbytes
        converted += nbytes if new else 0
    mtp = features.speculative == "mtp"   # the MTP head: its own inverse frequencies and fused MoE input
    made = (1 + mtp) * cfg.rotary_dim // 2 * _F32
    made += len(cfg.ple_layers) * _I64 * (cfg.ngram_size + 2 * cfg.ngram_heads)
    c35 = cfg.qwen35
    made += ((cfg.num_layers + mtp - len(grouped))
             * (fused_input_rows(c35) - cfg.num_experts - 2 * cfg.shared_expert_intermediate_size - 1)
             * cfg.hidden_size * run.itemsize)
    # The device cache of host experts and the copy path's staging buffer (ninfer_qwen3_5.layers.host_experts).
    if features.host_experts:
        slots = len(host_expert_layers(cfg, features)) * features.expert_cache_slots
        made += ((slots + min(STAGE_SLOTS, cfg.num_experts))
                 * 3 * cfg.moe_intermediate_size * cfg.hidden_size * run.itemsize)
    return resident + made, converted + made, host


def _activation_bytes_per_token(cfg: Qwen4ExpConfig, s: int) -> int:
    """Transient bytes one step token holds: the residual bank and a hyper-connection's temporaries, plus the widest
    sub-layer (GDN, attention with its indexer, PLE or MoE)."""
    nh, h, f = cfg.hc_width, cfg.hidden_size, _F32
    c = cfg.qwen35
    hc = s * (6 * nh + cfg.hc_lowrank + 2 * h) + f * nh
    widest = 0
    if cfg.gdn_layers:
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        widest = s * (3 * c.conv_dim + 3 * c.value_dim + h) + f * (2 * hv + 2 * hv * dk + 2 * hv * dv + 4 * hv * 64)
    if cfg.attention_layers:
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        idx = (cfg.indexer_heads + 1) * cfg.indexer_head_dim
        widest = max(widest, s * (6 * qd + 7 * kd + 3 * idx + 4 * cfg.indexer_width + h) + f * (qd + idx))
    if cfg.ple_layers:
        widest = max(widest, s * (2 * cfg.ple_embed_dim + 7 * nh + h) + f * 3 * nh + _I64 * 2 * cfg.ngram_heads)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    moe = s * (e + 3 * k * cfg.moe_intermediate_size + 3 * cfg.shared_expert_intermediate_size + 2 * h) + f * 2 * e
    return 2 * nh * s + hc + max(widest, moe)


def _matmul_params_per_token(cfg: Qwen4ExpConfig) -> int:
    h, nh, r, n = cfg.hidden_size, cfg.hc_width, cfg.hc_lowrank, cfg.hc_count
    c = cfg.qwen35
    total = 2 * nh * r   # the final reduction
    for i in range(cfg.num_layers):
        total += 2 * (2 * nh * r + n * nh)
        if i in cfg.attention_layers:
            qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            total += 2 * qd * h + 2 * kd * h + h * qd + (cfg.indexer_heads + 1) * cfg.indexer_head_dim * h
        else:
            total += (c.conv_dim * h + c.value_dim * h + 2 * c.linear_num_value_heads * h
                      + c.conv_dim * c.conv_kernel + h * c.value_dim)
        if i in cfg.ple_layers:
            total += (nh + h) * cfg.ple_embed_dim
        total += (cfg.num_experts * h + cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * h
                  + 3 * cfg.shared_expert_intermediate_size * h + h)
    return total


def profile(config: Mapping[str, Any], features: StartupFeatures, dtype: torch.dtype | None = None,
            stored_dtypes: Mapping[str, torch.dtype] | None = None,
            packed_bytes: Mapping[str, int] | None = None) -> ModelProfile:
    """The profile for run dtype ``dtype`` (None: bfloat16), the stored dtype of each parameter (None: all stored
    in ``dtype``) and the held bytes of each quantized one (``ArchitectureSpec.profile``)."""
    cfg = Qwen4ExpConfig.from_compact(config)
    run = dtype or torch.bfloat16
    s = run.itemsize
    weight_bytes, converted, host = _weights(cfg, config, features, run, stored_dtypes or {}, packed_bytes or {})
    layout = model_layout(cfg, run, mtp=features.speculative == "mtp", vision=features.vision)
    kv = layout.kv
    per_token = len(kv.layers) * 2 * kv.num_kv_heads * kv.head_dim * s + sum(
        2 * p.num_heads * p.head_dim * s for p in kv.side)
    n_attn, n_gdn = len(cfg.attention_layers), len(cfg.gdn_layers)
    kd = cfg.num_kv_heads * cfg.head_dim
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * s
    packed = packed_bytes or {}
    experts = 0
    for i in range(cfg.num_layers):   # a quantized bank: its stored bytes
        for part, rows in (("gate_up", 2), ("down", 1)):
            experts += packed.get(f"{layer_prefix('text', i)}/moe/experts/{part}",
                                  cfg.num_experts * rows * cfg.moe_intermediate_size * cfg.hidden_size * s)
    return ModelProfile(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=per_token,
        state_bytes_per_sequence=layout.state.image_bytes,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        converted_weight_bytes=converted,
        host_weight_bytes=host,
        activation_bytes_per_token=_activation_bytes_per_token(cfg, s),
        # The reference gathers a row's K and V (and, past the dense regime, its indexer keys and angles), then
        # copies them to fp32.
        attention_bytes_per_context_token=(2 * kd + 2 * cfg.indexer_width) * (s + _F32) if n_attn else 0,
        score_bytes_per_query_key=2 * _F32 * cfg.num_heads + 1 if n_attn else 0,
        matmul_params_per_token=_matmul_params_per_token(cfg),
        head_params=cfg.vocab_size * cfg.hidden_size,
        mixer_flops_per_token=n_gdn * cfg.linear_num_value_heads * 7 * cfg.linear_key_head_dim
        * cfg.linear_value_head_dim,
        attention_flops_per_query_key=n_attn * (cfg.num_heads * 4 * cfg.head_dim),
        embedding_bytes=embedding,
        routed_expert_bytes=experts,
        num_experts=cfg.num_experts,
        experts_per_token=cfg.num_experts_per_tok,
        encoder_bytes_per_row=encoder_bytes_per_row(config, s) if features.vision else 0,
        routed_experts_on_host=bool(features.host_experts),
        moe_layers=cfg.num_layers,
        host_read_bytes=experts * len(host_expert_layers(cfg, features)) // cfg.num_layers)


def summarize_config(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = Qwen4ExpConfig.from_compact(config)
    out: dict[str, Any] = {
        "architecture": "Qwen4ExpForCausalLM",
        "layers": f"{cfg.num_layers} ({len(cfg.gdn_layers)} GDN, {len(cfg.attention_layers)} QSA attention)",
        "hidden": f"{cfg.hidden_size} x {cfg.hc_count} streams (hyper-connections, rank {cfg.hc_lowrank})",
        "gdn": (f"{cfg.linear_num_key_heads}k/{cfg.linear_num_value_heads}v heads, {cfg.linear_key_head_dim}/"
                f"{cfg.linear_value_head_dim} dims, conv {cfg.conv_kernel}, {cfg.output_gate_type} output gate"),
        "moe": (f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}, width {cfg.moe_intermediate_size}, shared "
                f"{cfg.shared_expert_intermediate_size}"),
        "vocab": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "context": cfg.max_position_embeddings,
    }
    if cfg.attention_layers:
        out["attention"] = (f"{cfg.num_heads}q/{cfg.num_kv_heads}kv x {cfg.head_dim} (rotary {cfg.rotary_dim}); "
                            f"QSA {cfg.indexer_heads} index heads x {cfg.indexer_head_dim}, budget "
                            f"{cfg.indexer_budget} tokens in blocks of {cfg.indexer_compress_ratio}")
    if cfg.ple_layers:
        out["ple"] = (f"layers {list(cfg.ple_layer_ids)} (one-based), {cfg.ngram_heads} hash heads of "
                      f"{cfg.ple_head_dim} dims, n-grams up to {cfg.ngram_size}")
    return out
