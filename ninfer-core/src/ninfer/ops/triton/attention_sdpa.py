"""Prefill attention through torch's fused scaled-dot-product attention: a candidate beside the Triton kernel.

``NINFER_ATTN_SDPA=1`` (read once; ``0`` default) sends the 16-bit ``paged_attention`` calls of
:mod:`ninfer.ops.triton.attention` here when they are not being captured into a CUDA graph. At the 9B's heads
(16 query / 4 KV heads of 256) torch's flash kernel ran an 8k causal prompt at 81% of the matmul peak on an H100,
where the Triton kernel reached 40% (tools/gpu_prefill_attention_sweep.py); whether that shows end to end is for
tools/gpu_prefill_kernels_ab.py to say.

Same contract as :func:`ninfer.ops.reference.attention.paged_attention`: each row's KV positions are gathered from
the pool through its page table (only its first ceil(kv_len / page) entries, only positions < kv_len) into
contiguous tensors, and query i of a row with q_len queries attends to positions <= kv_len - q_len + i (causal
aligned to the bottom right, so a chunk after a cached prefix sees the prefix). A row without a prefix takes SDPA's
own causal mask with grouped-query heads; a row with one expands the KV heads and takes the bottom-right causal
bias. The gate multiplies as the reference does, ``out * sigmoid(gate)`` in q's dtype.

What it costs beside the kernel: the row boundaries are read on the host (one synchronisation per call, hence
never during graph capture) and each row's KV is copied once out of the pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ninfer.switches import env_switch

ENABLED = env_switch("NINFER_ATTN_SDPA", False)
_DTYPES = (torch.bfloat16, torch.float16)


def usable(q: torch.Tensor) -> bool:
    """Whether a ``paged_attention`` call on ``q`` takes this path: enabled, 16-bit, on CUDA, not capturing."""
    return (ENABLED and q.dtype in _DTYPES and q.device.type == "cuda"
            and not torch.cuda.is_current_stream_capturing())


def _gather(pool: torch.Tensor, table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    page = pool.shape[1]
    pages = table_row[:-(-kv_len // page)].to(torch.long)
    return pool.index_select(0, pages).reshape((-1,) + pool.shape[2:])[:kv_len]


def paged_attention_sdpa(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_q: torch.Tensor,
                         kv_lens: torch.Tensor, page_tables: torch.Tensor, scale: float,
                         gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA for ``q[T, Hq, D]`` split into rows by ``cu_q`` (the module's contract)."""
    hq, hkv = q.shape[1], k_pool.shape[2]
    if hq % hkv:
        raise ValueError(f"paged attention: {hq} query heads are not a multiple of {hkv} KV heads")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts, lens = cu_q.tolist(), kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        if n > kv_len:
            raise ValueError(f"paged attention: {n} queries but only {kv_len} KV positions")
        qt = q[q0:q1].transpose(0, 1).unsqueeze(0)                                # [1, Hq, n, D]
        kt = _gather(k_pool, page_tables[b], kv_len).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vt = _gather(v_pool, page_tables[b], kv_len).transpose(0, 1).unsqueeze(0)
        if n == kv_len:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=hq != hkv)
        else:
            r = hq // hkv
            kt, vt = kt.repeat_interleave(r, dim=1), vt.repeat_interleave(r, dim=1)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(n, kv_len), scale=scale)
        out[q0:q1] = o[0].transpose(0, 1)
    if gate is not None:
        out = out * torch.sigmoid(gate.reshape(q.shape).to(q.dtype))
    return out
