"""Address-free sizes of a Qwen3.5 instance for the planner (ModelProfile) and ``ninfer info``.

Exact figures mirror what :class:`~ninfer_qwen3_5.program.Qwen35Program` allocates for a run dtype:

- weights: every Text parameter in the run dtype (the model casts float weights once), except
  ``gdn/A_log`` and ``gdn/dt_bias``, which the GDN layer keeps as fp32 tensors derived from them
  (``-exp(A_log)`` and ``dt_bias.float()``); a tied head is counted once; plus the fp32 rotary inverse
  frequencies. Converted bytes are those created at construction: casts of weights stored in another
  dtype, the decay rates, the inverse frequencies, and the MoE block's fused input projection
  (router + shared gate_up + shared gate rows concatenated; the stored originals are dropped after).
- KV: K and V of every full-attention layer, ``Nkv * D`` each per token, run dtype; with
  ``speculative == "mtp"`` one more such layer (the MTP layer's own pool), and the weights then include the
  ``mtp`` component's parameters (:func:`~ninfer_qwen3_5.parameters.parameter_specs` selects them); with
  ``speculative`` ``"dflash"`` / ``"dflash2"`` one more per drafter layer of the drafter's head geometry, and the
  weights include the ``dflash`` component's (its plain norm weights kept as fp32 offsets, its key and value
  rows concatenated into one new tensor, the fp32 rotary inverse frequencies); ``default_speculative_tokens``
  is then the drafter's block size - 1.
- State: the StateImage of :mod:`ninfer_qwen3_5.state` (conv in the run dtype, recurrent fp32; with vision the
  rope delta too).
- Vision (``features.vision``): the tower's parameters, all in the run dtype (selected by ``parameter_specs``),
  and the encoder's workspace per input row (:func:`encoder_bytes_per_row`).

The workspace terms are estimates of the torch reference path's temporaries (the planner's headroom
covers their error); the compute terms count multiply-adds as two FLOPs.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any

import torch
from ninfer.contracts.architecture import ModelProfile, ParameterSpec
from ninfer.contracts.features import StartupFeatures

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.dflash.config import TEXT_KEY
from ninfer_qwen3_5.dflash.parameters import drafter_config
from ninfer_qwen3_5.layers.host_experts import STAGE_SLOTS
from ninfer_qwen3_5.layers.moe import fused_input_rows
from ninfer_qwen3_5.ops.reference.segment_attention import QUERY_BLOCK
from ninfer_qwen3_5.parameters import host_expert_layers, host_placed, layer_prefix, parameter_specs
from ninfer_qwen3_5.state import state_layout
from ninfer_qwen3_5.vision.config import VisionConfig

_F32 = 4
# Parameters the GDN layer replaces by fp32 tensors derived from them at construction.
_FP32_DERIVED = ("gdn/A_log", "gdn/dt_bias")
# Parameters the MoE block concatenates (with zero rows: layers/moe.py) into one new tensor at construction.
_MOE_FUSED_INPUT = ("moe/router", "moe/shared/gate_up", "moe/shared/gate")
# DFlash drafter parameters prepared as new tensors (dflash/weights.py, dflash/drafter.py).
_DFLASH_NORMS = ("/hidden_norm", "/norm", "/input_norm", "/post_norm", "/q_norm", "/k_norm")
_DFLASH_KV = ("/attention/key", "/attention/value")
# The reference GDN prefill's chunk length: its intra-chunk [L, L] matrices cost L fp32 per head per token.
_GDN_CHUNK = 64


def grouped_moe_blocks(packed: Mapping[str, int]) -> set[str]:
    """The layer prefixes whose MoE block keeps a quantized router or shared-expert input as separate groups
    (layers/moe.py): nothing is concatenated, so its dense parts are not new and it has no padding rows."""
    return {name.rsplit("/moe/", 1)[0] for name in packed if name.endswith(_MOE_FUSED_INPUT)}


def packed_held(spec: ParameterSpec, packed: Mapping[str, int]) -> tuple[int, int] | None:
    """(device bytes, host bytes) a quantized parameter holds, kept as loaded wherever it is placed; None for a
    dense one."""
    if spec.name not in packed:
        return None
    return (0, packed[spec.name]) if spec.placement == "host" else (packed[spec.name], 0)


def _weights(cfg: Qwen35Config, config: Mapping[str, Any], features: StartupFeatures, run: torch.dtype,
             stored: Mapping[str, torch.dtype], packed: Mapping[str, int]) -> tuple[int, int, int]:
    """(resident bytes on the run device, bytes created at construction, bytes placed in host memory)."""
    resident = converted = host = 0
    grouped = grouped_moe_blocks(packed)
    for s in parameter_specs(config, features):
        if cfg.tie_word_embeddings and s.name == "text/lm_head":
            continue  # the same tensor as text/embed
        if (held_packed := packed_held(s, packed)) is not None:
            resident, host = resident + held_packed[0], host + held_packed[1]
            continue
        held = stored.get(s.name, run)
        if s.placement == "host":   # host expert banks and a host embedding are kept as stored
            host += prod(s.shape) * held.itemsize
            continue
        if s.name.endswith(_FP32_DERIVED):
            kept = torch.float32
            new = s.name.endswith("gdn/A_log") or held != torch.float32  # -exp() is always a new tensor
        elif s.name.startswith("dflash/") and s.name.endswith(_DFLASH_NORMS):
            kept, new = torch.float32, True       # w - 1 in fp32 (dflash/weights.py)
        elif s.name.startswith("dflash/") and s.name.endswith(_DFLASH_KV):
            kept, new = run, True                 # concatenated into the drafter's ctx_kv
        else:
            fused = s.name.endswith(_MOE_FUSED_INPUT) and s.name.rsplit("/moe/", 1)[0] not in grouped
            kept, new = run, held != run or fused
        nbytes = prod(s.shape) * kept.itemsize
        resident += nbytes
        converted += nbytes if new else 0
    inv_freq = cfg.rotary_dim // 2 * _F32
    if features.speculative in ("dflash", "dflash2"):
        inv_freq += drafter_config(config).head_dim // 2 * _F32
    # The fused MoE input weight's zero rows (layers/moe.py: ROW_ALIGN), made at construction.
    fused_layers = sum(1 for i in range(cfg.num_layers) if layer_prefix("text", i) not in grouped)
    pad = (fused_layers * (fused_input_rows(cfg) - cfg.num_experts - 2 * cfg.shared_expert_intermediate_size - 1)
           * cfg.hidden_size * run.itemsize if cfg.is_moe else 0)
    # The device cache of host experts (layers/expert_cache.py), in the run dtype, or as stored when quantized (a
    # byte a weight: the binder's uint8 view, at most the stored size of the formats below 8 bits).
    # Plus the copy path's staging buffer (layers/host_experts.py), counted whether or not it is ever allocated.
    bank = stored.get(layer_prefix("text", 0) + "/moe/experts/gate_up", run)
    per_weight = bank.itemsize if bank == torch.uint8 else run.itemsize
    slots = len(host_expert_layers(cfg, features)) * features.expert_cache_slots
    cache = ((slots + min(STAGE_SLOTS, cfg.num_experts))
             * 3 * cfg.moe_intermediate_size * cfg.hidden_size * per_weight
             if cfg.is_moe and features.host_experts else 0)
    return resident + inv_freq + pad + cache, converted + inv_freq + pad + cache, host


def _activation_bytes_per_token(cfg: Qwen35Config, s: int) -> int:
    """Transient bytes one step token holds at the widest layer, plus the residual stream."""
    H, f = cfg.hidden_size, _F32
    widest = 0
    if cfg.gdn_layers:
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # qkv, conv output, contiguous q/k/v; z, o, gated norm; out projection.
        gdn = s * (3 * cfg.conv_dim + 3 * cfg.value_dim + H)
        # gates; normalised q, k expanded to the value heads; v and o in fp32; intra-chunk matrices.
        gdn += f * (2 * hv + 2 * hv * dk + 2 * hv * dv + 4 * hv * _GDN_CHUNK)
        widest = max(widest, gdn)
    if cfg.attention_layers:
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q (projected, normed, rotated), k likewise, v, gate, output and gated output; fp32 output.
        attn = s * (6 * qd + 7 * kd + H) + f * qd
        widest = max(widest, attn)
    if cfg.is_moe:
        E, k, ie, ish = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                         cfg.shared_expert_intermediate_size)
        mlp = s * (E + 3 * k * ie + 3 * ish + 2 * H) + f * 2 * E
    else:
        mlp = s * (3 * cfg.intermediate_size + H)
    return 4 * H * s + max(widest, mlp)


def encoder_bytes_per_row(config: Mapping[str, Any], s: int) -> int:
    """Transient bytes of one tower call per input row (:mod:`ninfer_qwen3_5.vision.tower` on the torch reference
    ops), summed over its stages rather than maximised (an upper bound): the input rows and the fp32 position
    taps (4 taps, weighted, summed); a block's residual, norm, qkv, rotated q and k, fp32 attention output and its
    cast, projection; the MLP's two widths; the merged output. Plus the attention's live fp32 scores and softmax:
    ``QUERY_BLOCK`` queries of every head against each key (a call's rows bound its longest segment)."""
    v = VisionConfig.from_compact(config["vision_config"])
    hid, inter, f = v.hidden_size, v.intermediate_size, _F32
    linear = s * (v.patch_values + 10 * hid + 2 * inter + v.out_hidden_size // v.merge_unit)
    fp32 = f * (9 * hid + 2 * hid + 2 * v.head_dim)   # position taps, q/k/v of a segment, attention out, cos/sin
    return linear + fp32 + 2 * f * v.num_heads * QUERY_BLOCK


def _drafter_taps_bytes(cfg: Qwen35Config, config: Mapping[str, Any], features: StartupFeatures, s: int) -> int:
    """A DFlash Program's extra transient bytes per step token: the tapped layer outputs (held until they are
    concatenated, then the concatenation), the drafter's fused context and every layer's context K and V."""
    if features.speculative not in ("dflash", "dflash2"):
        return 0
    d = drafter_config(config)
    return s * (2 * len(d.target_layer_ids) * cfg.hidden_size + d.hidden_size
                + 2 * d.num_layers * d.num_kv_heads * d.head_dim)


def _matmul_params_per_token(cfg: Qwen35Config) -> int:
    H, total = cfg.hidden_size, 0
    for kind in cfg.layer_types:
        if kind == "full_attention":
            qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            total += 2 * qd * H + 2 * kd * H + H * qd
        else:
            hv = cfg.linear_num_value_heads
            total += (cfg.conv_dim * H + cfg.value_dim * H + 2 * hv * H + cfg.conv_dim * cfg.conv_kernel
                      + H * cfg.value_dim)
        if cfg.is_moe:
            ie, ish = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            total += cfg.num_experts * H + cfg.num_experts_per_tok * 3 * ie * H + 3 * ish * H + H
        else:
            total += 3 * cfg.intermediate_size * H
    return total


def profile(config: Mapping[str, Any], features: StartupFeatures, dtype: torch.dtype | None = None,
            stored_dtypes: Mapping[str, torch.dtype] | None = None,
            packed_bytes: Mapping[str, int] | None = None) -> ModelProfile:
    """The profile for run dtype ``dtype`` (None: bfloat16, what the engine runs on CUDA), the stored
    dtype of each parameter (None: all stored in ``dtype``) and the held bytes of each quantized one
    (``ArchitectureSpec.profile``)."""
    cfg = Qwen35Config.from_compact(config)
    run = dtype or torch.bfloat16
    s = run.itemsize
    packed = packed_bytes or {}
    weight_bytes, converted, host_bytes = _weights(cfg, config, features, run, stored_dtypes or {}, packed)
    n_attn, n_gdn = len(cfg.attention_layers), len(cfg.gdn_layers)
    n_kv = n_attn + (1 if features.speculative == "mtp" else 0)   # the MTP layer's KV pool
    kd = cfg.num_kv_heads * cfg.head_dim
    drafter_kv, default_tokens = 0, 0
    if features.speculative in ("dflash", "dflash2"):
        d = drafter_config(config)
        drafter_kv, default_tokens = d.num_layers * 2 * d.num_kv_heads * d.head_dim * s, d.block_size - 1
    # Read in part at decode: the untied input table (one row per token), the routed experts (top-k of E).
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * s
    experts = 0
    if cfg.is_moe:   # a quantized bank: its stored bytes
        dense = {"gate_up": 2, "down": 1}
        for i in range(cfg.num_layers):
            for part, rows in dense.items():
                name = f"{layer_prefix('text', i)}/moe/experts/{part}"
                experts += packed.get(name, cfg.num_experts * rows * cfg.moe_intermediate_size * cfg.hidden_size * s)
    host_layers = len(host_expert_layers(cfg, features))
    host_read = (experts * host_layers // cfg.num_layers
                 + (embedding if "text/embed" in host_placed(cfg, features) else 0))
    return ModelProfile(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=n_kv * 2 * kd * s + drafter_kv,
        state_bytes_per_sequence=state_layout(cfg, run, vision=features.vision).image_bytes,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        converted_weight_bytes=converted,
        activation_bytes_per_token=_activation_bytes_per_token(cfg, s) + _drafter_taps_bytes(cfg, config, features, s),
        # The reference attention gathers a row's K and V pages, then copies them to fp32.
        attention_bytes_per_context_token=2 * kd * (s + _F32) if n_attn else 0,
        # Scores and their softmax, fp32, for every query head.
        score_bytes_per_query_key=2 * _F32 * cfg.num_heads if n_attn else 0,
        matmul_params_per_token=_matmul_params_per_token(cfg),
        head_params=cfg.vocab_size * cfg.hidden_size,
        # Per value head and token: decay S, S^T k, the rank-1 update and S^T q (Dk x Dv each).
        mixer_flops_per_token=n_gdn * cfg.linear_num_value_heads * 7 * cfg.linear_key_head_dim
        * cfg.linear_value_head_dim,
        # QK^T and PV: 2 * D FLOPs each per query head.
        attention_flops_per_query_key=n_attn * cfg.num_heads * 4 * cfg.head_dim,
        embedding_bytes=embedding,
        routed_expert_bytes=experts,
        num_experts=cfg.num_experts if cfg.is_moe else 0,
        experts_per_token=cfg.num_experts_per_tok if cfg.is_moe else 0,
        encoder_bytes_per_row=encoder_bytes_per_row(config, s) if features.vision else 0,
        default_speculative_tokens=default_tokens,
        host_weight_bytes=host_bytes,
        routed_experts_on_host=bool(host_layers),
        moe_layers=cfg.num_layers if cfg.is_moe else 0,
        host_read_bytes=host_read)


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
    if config.get(TEXT_KEY) is not None:
        d = drafter_config(config)
        out["dflash"] = (f"{d.architecture}, {d.num_layers} layers, block {d.block_size}, target layers "
                         f"{list(d.target_layer_ids)}")
    return out
