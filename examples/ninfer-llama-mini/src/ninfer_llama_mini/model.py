"""The model math: embedding, pre-norm decoder layers (GQA attention over the paged KV, SwiGLU MLP), final
norm and LM head, every computation but the embedding gather and the rotary table through the OpSet.

Weights: the loader hands over the stored tensors read-only, in their stored dtype. The model casts each
float weight stored in another dtype to the run dtype once, here, at construction, into a new tensor (a tied
head is cast once, with the embedding). Nothing is cast in the forward.

One call sees a :class:`~ninfer.program.batch.PackedBatch` of N tokens: the decode rows first, one token
each, then the prefill chunks, each of one sequence. Every token's K and V are written to its flat KV slot
(``slot_mapping``); the decode rows then attend with ``paged_decode_attention`` (their page tables and KV
lengths), the chunks with one varlen ``paged_attention`` (each causal over its cached prefix and itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import PackedBatch
from ninfer.storage.kv_pool import PagedKVCache

from ninfer_llama_mini.config import LlamaMiniConfig
from ninfer_llama_mini.parameters import layer_prefix, text_shapes


def prepare_weights(cfg: LlamaMiniConfig, weights: Mapping[str, torch.Tensor],
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter, checked and in ``dtype``: the stored tensor itself when it already is, else a cast."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in text_shapes(cfg).items():
        if name == "text/lm_head" and cfg.tie_word_embeddings:
            continue
        w = weights.get(name)
        if w is None or tuple(w.shape) != shape or not w.dtype.is_floating_point:
            found = None if w is None else (tuple(w.shape), w.dtype)
            raise ProgramError(f"parameter {name!r}: expected a float tensor of shape {shape}, got {found}")
        out[name] = w if w.dtype == dtype else w.to(dtype)
    if cfg.tie_word_embeddings:
        out["text/lm_head"] = out["text/embed"]
    return out


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    out: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LlamaMiniModel:
    def __init__(self, cfg: LlamaMiniConfig, weights: Mapping[str, torch.Tensor], ops, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.cfg, self.ops = cfg, ops
        w = prepare_weights(cfg, weights, dtype)
        self.embed, self.norm, self.lm_head = w["text/embed"], w["text/norm"], w["text/lm_head"]
        self.layers = [Layer(*(w[f"{layer_prefix(i)}/{n}"] for n in ("input_norm", "attention/qkv", "attention/out",
                                                                    "post_norm", "mlp/gate_up", "mlp/down")))
                       for i in range(cfg.num_layers)]
        d = cfg.head_dim
        # RoPE's inverse frequencies, fp32, computed as transformers computes them (the one derived constant).
        self.inv_freq = (1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)).to(device)
        self.splits = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)
        self.scale = d ** -0.5

    def forward(self, batch: PackedBatch, kv: PagedKVCache) -> torch.Tensor:
        """fp32 logits ``[R, V]`` of the tokens ``batch.logit_rows`` names (every token when None)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        x = self.embed.index_select(0, batch.tokens)
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for i, layer in enumerate(self.layers):
            h = ops.llama_rms_norm(x, layer.input_norm, eps)
            x = x + self.attention(i, layer, h, cos, sin, batch, kv)
            h = ops.llama_rms_norm(x, layer.post_norm, eps)
            x = x + ops.linear(ops.silu_and_mul(ops.linear(h, layer.gate_up)), layer.down)
        if batch.logit_rows is not None:
            x = x.index_select(0, batch.logit_rows)
        return ops.logits(ops.llama_rms_norm(x, self.norm, eps), self.lm_head)

    def attention(self, index: int, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: PackedBatch, kv: PagedKVCache) -> torch.Tensor:
        ops, cfg, n, b = self.ops, self.cfg, h.shape[0], batch.num_decode
        q, k, v = ops.linear(h, layer.qkv).split(self.splits, dim=-1)
        q = ops.rope(q.reshape(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = ops.rope(k.reshape(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        k_pool, v_pool = kv.pools(index)
        ops.kv_cache_write(k, v.reshape(n, cfg.num_kv_heads, cfg.head_dim), k_pool, v_pool, batch.slot_mapping)
        outs = []
        if b:
            outs.append(ops.paged_decode_attention(q[:b], k_pool, v_pool, batch.decode_kv_lens,
                                                   batch.decode_page_tables, self.scale))
        if batch.num_chunk:
            outs.append(ops.paged_attention(q[b:], k_pool, v_pool, batch.chunk_cu_q, batch.chunk_kv_lens,
                                            batch.chunk_page_tables, self.scale))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return ops.linear(o.reshape(n, cfg.num_heads * cfg.head_dim), layer.out)
