"""The indexed (QSA) attention of one layer: Qwen3.5's gated attention whose keys are chosen per query by an indexer
(docs/architectures/qwen4exp.md).

One GEMM projects the layer input to query, key, value, output gate, indexer queries and the indexer's token key
(one ``attention/in_proj`` parent). q and k get Qwen3.5's (1 + w) norms and partial RoPE and K/V go to the layer's
paged pools (``qk_norm_rope_cache``); the indexer's queries get their own (1 + w) norm and the same RoPE, and each
token's raw indexer key and rotary cos | sin go to the layer's side pool (``indexer_cache_write``), so a later step can
pool any complete block of r tokens. Then per query: ``qsa_select`` ranks the complete blocks it sees and keeps the
best ``indexer_budget / r`` of them plus the incomplete tail, and ``qsa_attention`` attends over those positions
and gates its output by ``sigmoid(gate)`` as it stores it; the result is projected.

While a row's KV length stays within ``block_topk * r + r - 1`` positions every query sees at most ``block_topk``
complete blocks and selects them all: the layer is exactly causal attention. When the call's page tables cannot
describe more than ``block_topk`` complete blocks (a shape, so no host read and nothing a CUDA graph cannot hold),
every row is in that regime and the layer runs core's paged attention; otherwise the QSA ops, which keep every
position of a query that sees at most ``block_topk`` blocks.
"""

from __future__ import annotations

import torch
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import project, row_groups

from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.state import indexer_pool


class QSAAttention:
    def __init__(self, cfg: Qwen4ExpConfig, index: int, w: dict[str, torch.Tensor], ops) -> None:
        self.ops, self.index, self.eps = ops, index, cfg.rms_norm_eps
        self.nq, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.ih, self.idim = cfg.indexer_heads, cfg.indexer_head_dim
        self.ratio, self.block_topk, self.rotary = cfg.indexer_compress_ratio, cfg.block_topk, cfg.rotary_dim
        self.scale = self.d ** -0.5
        self.in_groups = row_groups([w["query"], w["key"], w["value"], w["gate"], w["indexer_q"], w["indexer_k"]])
        self.w_qn, self.w_kn, self.w_out = w["q_norm"], w["k_norm"], w["out"]
        self.w_iqn, self.w_ikn = w["indexer_q_norm"], w["indexer_k_norm"]
        self.pool_name = indexer_pool(index)

    def __call__(self, u: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        ops, n, b_rows = self.ops, u.shape[0], ctx.num_decode
        q, k, v, gate, iq, ik = project(ops, u, self.in_groups)
        k_pool, v_pool = ctx.kv.pools(self.index)
        q, _ = ops.qk_norm_rope_cache(q.view(n, self.nq, self.d), k.view(n, self.nkv, self.d),
                                      v.view(n, self.nkv, self.d), self.w_qn, self.w_kn, self.eps, ctx.cos, ctx.sin,
                                      k_pool, v_pool, ctx.slot_mapping)
        iq = ops.rope(ops.rms_norm_unit_offset(iq.reshape(n, self.ih, self.idim), self.w_iqn, self.eps),
                      ctx.cos, ctx.sin)
        ik_pool, rope_pool = ctx.kv.pools(self.pool_name)
        ops.indexer_cache_write(ik, ctx.cos, ctx.sin, ik_pool, rope_pool, ctx.slot_mapping)
        outs = []   # each gated by sigmoid(gate) where the attention stores it
        if b_rows:
            cu = torch.arange(b_rows + 1, dtype=torch.int32, device=u.device)
            outs.append(self._attend(q[:b_rows], iq[:b_rows], gate[:b_rows], cu, ctx.decode_kv_lens,
                                     ctx.decode_page_tables, ctx))
        if ctx.num_chunk:
            outs.append(self._attend(q[b_rows:], iq[b_rows:], gate[b_rows:], ctx.chunk_cu_q, ctx.chunk_kv_lens,
                                     ctx.chunk_page_tables, ctx))
        o = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(n, self.nq * self.d)
        return ops.linear(o, self.w_out)

    def _attend(self, q: torch.Tensor, iq: torch.Tensor, gate: torch.Tensor, cu_q: torch.Tensor,
                kv_lens: torch.Tensor, page_tables: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        ops = self.ops
        k_pool, v_pool = ctx.kv.pools(self.index)
        q = q.contiguous()
        if page_tables.shape[1] * k_pool.shape[1] // self.ratio <= self.block_topk:   # every query keeps all it sees
            return ops.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, page_tables, self.scale, gate)
        ik_pool, rope_pool = ctx.kv.pools(self.pool_name)
        sel = ops.qsa_select(iq, ik_pool, rope_pool, self.w_ikn, self.eps, cu_q, kv_lens, page_tables, self.ratio,
                             self.block_topk, self.rotary)
        return ops.qsa_attention(q, k_pool, v_pool, sel, cu_q, kv_lens, page_tables, self.scale, gate)
