"""The gated full-attention mixer of one layer (reference doc section 6).

q and gate come from the de-interleaved ``attention/query`` / ``attention/gate`` bindings; q_norm and
k_norm (zero-centred, per head) precede partial NeoX RoPE; K (normed, rotated) and raw V are written
to the paged pools for every token of the call (all of it one ``qk_norm_rope_cache``), then decode rows use
``paged_decode_attention`` and the chunks one varlen ``paged_attention`` (each causal over its own cached
prefix). Output: ``attn * sigmoid(gate)``, applied by the attention ops themselves where they store their outputs.
"""

from __future__ import annotations

import torch

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import NormInput, norm_project, row_groups


class GatedAttention:
    def __init__(self, cfg: Qwen35Config, index: int, w: dict[str, torch.Tensor], ops) -> None:
        self.ops = ops
        self.index = index
        self.eps = cfg.rms_norm_eps
        self.nq, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.d ** -0.5
        self.w_q, self.w_gate, self.w_k, self.w_v = w["query"], w["gate"], w["key"], w["value"]
        self.w_qn, self.w_kn, self.w_out = w["q_norm"], w["k_norm"], w["out"]
        self.in_groups = row_groups([self.w_q, self.w_k, self.w_v, self.w_gate])

    def __call__(self, inp: NormInput, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        ops, n, b_rows = self.ops, inp.residual.shape[0], ctx.num_decode
        (q, k, v, gate), _, residual = norm_project(ops, inp, self.in_groups)
        k_pool, v_pool = ctx.kv.pools(self.index)
        q, _ = ops.qk_norm_rope_cache(q.view(n, self.nq, self.d), k.view(n, self.nkv, self.d),
                                      v.view(n, self.nkv, self.d), self.w_qn, self.w_kn, self.eps, ctx.cos, ctx.sin,
                                      k_pool, v_pool, ctx.slot_mapping)
        if b_rows and not ctx.num_chunk:
            # Decode only: the output gate is applied where the attention stores its output (no extra launches).
            o = ops.paged_decode_attention(q, k_pool, v_pool, ctx.decode_kv_lens, ctx.decode_page_tables,
                                           self.scale, gate)
            return ops.linear(o.reshape(n, self.nq * self.d), self.w_out), residual
        # Both attentions apply the output gate where they store their outputs.
        outs = []
        if b_rows:
            outs.append(ops.paged_decode_attention(q[:b_rows].contiguous(), k_pool, v_pool, ctx.decode_kv_lens,
                                                   ctx.decode_page_tables, self.scale, gate[:b_rows]))
        if ctx.num_chunk:
            outs.append(ops.paged_attention(q[b_rows:].contiguous(), k_pool, v_pool, ctx.chunk_cu_q,
                                            ctx.chunk_kv_lens, ctx.chunk_page_tables, self.scale, gate[b_rows:]))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        if ctx.token_valid is not None:   # a padded flat call: tokens in no row were never computed
            o = torch.where(ctx.token_valid, o, 0.0)
        return ops.linear(o.reshape(n, self.nq * self.d), self.w_out), residual
