"""Torch reference paged causal GQA attention (prefill over a cached prefix, and decode).

Invariants:
- Row b owns KV positions 0 .. kv_lens[b]-1; position p lives at
  ``pool[page_tables[b, p // page], p % page]``. Only the first ceil(kv_lens[b] / page) page-table entries
  of a row are read, and pool slots at positions >= kv_lens[b] are never read (they may hold garbage).
- Query i of a row with q_len queries sits at position kv_lens[b] - q_len + i and attends to positions
  <= its own (so q_len <= kv_lens[b]). Query head h reads KV head h // (Hq / Hkv).
- Scores, softmax and the weighted sum are fp32; the output is rounded once to q's dtype.
- The result depends only on the KV *values*, not on where the pages sit in the pool: identity, offset or
  permuted page tables give bit-identical outputs (the gathered [L, Hkv, D] tensor is the same).
"""

from __future__ import annotations

import torch

from ninfer.ops.registry import OpImpl

# Upper bound on query-block x key-length x heads score elements materialised at once (fp32), so a long
# prefill never builds a full [Hq, T, L] matrix on CPU.
_SCORE_BUDGET = 1 << 24


def _gather_kv(pool: torch.Tensor, table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    page = pool.shape[1]
    n_pages = -(-kv_len // page)
    pages = table_row[:n_pages].to(device=pool.device, dtype=torch.long)
    return pool.index_select(0, pages).reshape((n_pages * page,) + pool.shape[2:])[:kv_len]


def _attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q[n, Hq, D] (the last n positions) over k/v[L, Hkv, D]; returns fp32 [n, Hq, D]."""
    n, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"paged attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if n > kv_len:
        raise ValueError(f"paged attention: {n} queries but only {kv_len} KV positions")
    r = hq // hkv
    kf = k.float().permute(1, 2, 0)                       # [Hkv, D, L]
    vf = v.float().transpose(0, 1)                        # [Hkv, L, D]
    out = torch.empty((n, hq, d), dtype=torch.float32, device=q.device)
    key_pos = torch.arange(kv_len, device=q.device)
    block = max(1, _SCORE_BUDGET // max(1, hq * kv_len))
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        # [Hkv, r * nb, D]: query head h = kvh * r + j (repeat_interleave order) for GQA grouping.
        qb = q[i0:i1].float().reshape(i1 - i0, hkv, r, d).permute(1, 2, 0, 3).reshape(hkv, r * (i1 - i0), d)
        scores = (qb @ kf) * scale                        # [Hkv, r * nb, L]
        q_pos = kv_len - n + torch.arange(i0, i1, device=q.device)
        masked = (key_pos[None, :] > q_pos[:, None]).repeat(r, 1)  # [r * nb, L], rows ordered (j, query)
        scores = scores.masked_fill(masked[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = (probs @ vf).reshape(hkv, r, i1 - i0, d).permute(2, 0, 1, 3).reshape(i1 - i0, hq, d)
        out[i0:i1] = ob
    return out


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_q: torch.Tensor,
                    kv_lens: torch.Tensor, page_tables: torch.Tensor, scale: float,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA for ``q[T, Hq, D]`` split into rows by ``cu_q``; see the module invariants. With
    ``gate[T, Hq*D]``, times ``sigmoid(gate)`` as torch computes it in q.dtype."""
    starts = cu_q.tolist()
    lens = kv_lens.tolist()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b, kv_len in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        k = _gather_kv(k_pool, page_tables[b], kv_len)
        v = _gather_kv(v_pool, page_tables[b], kv_len)
        out[q0:q1] = _attend_row(q[q0:q1], k, v, scale).to(q.dtype)
    if gate is not None:
        out = out * torch.sigmoid(_gate_view(gate, q, "paged_attention").to(q.dtype))
    return out


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_lens: torch.Tensor,
                           page_tables: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row at its last position: ``q[B, Hq, D]`` over ``kv_lens[b]`` cached positions; with
    ``gate[B, Hq*D]``, times ``sigmoid(gate)`` as torch computes it in q.dtype."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b, kv_len in enumerate(kv_lens.tolist()):
        k = _gather_kv(k_pool, page_tables[b], kv_len)
        v = _gather_kv(v_pool, page_tables[b], kv_len)
        out[b:b + 1] = _attend_row(q[b:b + 1], k, v, scale).to(q.dtype)
    if gate is not None:
        out = out * torch.sigmoid(_gate_view(gate, q, "paged_decode_attention").to(q.dtype))
    return out


def _gate_view(gate: torch.Tensor, q: torch.Tensor, op: str) -> torch.Tensor:
    """``gate[rows, Hq*D]`` as ``[rows, Hq, D]`` (a row-strided gate reshapes by copy in the reference)."""
    b, hq, d = q.shape
    if gate.shape != (b, hq * d):
        raise ValueError(f"{op}: gate {tuple(gate.shape)} must be [rows, Hq*D] = {(b, hq * d)}")
    return gate.reshape(b, hq, d)


OPS = [
    OpImpl(op="paged_attention", name="torch_reference", fn=paged_attention, priority=0),
    OpImpl(op="paged_decode_attention", name="torch_reference", fn=paged_decode_attention, priority=0),
]
