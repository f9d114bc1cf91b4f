"""Torch reference of QSA (query-sparse attention): the indexer's block selection and the attention over it.

Invariants:
- Blocks are the consecutive ``r`` positions ``[jr, jr + r)`` of a sequence counted from its first token, so a
  block's key, and every score, is the same whichever step or chunk computes it: the pools hold each token's raw
  indexer key and its rotary cos | sin, and a complete block is pooled from them on demand.
- The selection of query position p depends only on the sequence's tokens up to p (causal): the blocks it ranks
  are the complete ones within ``[0, p]``, and the incomplete tail ``[n_vis * r, p]`` is always kept. When
  ``n_vis <= block_topk`` every position ``<= p`` is selected, so the layer is exactly dense causal attention.
- Each query's scores are one fp32 ``[h, d] x [d, n_vis]`` matmul and its choice one ``torch.topk`` over those
  ``n_vis`` scores, the same calls transformers makes, so ties (relu makes exact zeros common) break the same way.
- This reference reads its row metadata on the host (a device synchronisation) and loops over queries: it is the
  semantic definition, not a decode-graph-capturable kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from ninfer.ops.reference.kv_cache import kv_cache_write
from ninfer.ops.registry import OpImpl


def _positions(page_table: torch.Tensor, n: int, page: int) -> torch.Tensor:
    """Flat pool slots of positions ``[0, n)`` of a row."""
    pos = torch.arange(n, device=page_table.device)
    return page_table.long()[pos // page] * page + pos % page


def _rows(cu_q: torch.Tensor, kv_lens: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first query index, query count, kv length)`` per row, on the host."""
    cu, kv = cu_q.tolist(), kv_lens.tolist()
    out = []
    for b, n_kv in enumerate(kv):
        q0, q1 = cu[b], cu[b + 1]
        if q1 - q0 > n_kv:
            raise ValueError(f"QSA: row {b} has {q1 - q0} queries but only {n_kv} cached positions")
        out.append((q0, q1 - q0, n_kv))
    return out


def _block_keys(keys: torch.Tensor, rope: torch.Tensor, k_norm: torch.Tensor, eps: float, r: int,
                rotary: int) -> torch.Tensor:
    """The keys of the complete blocks of one row: ``keys[n, d]`` raw, ``rope[n, 2R]`` cos | sin per position."""
    nb = keys.shape[0] // r
    d = keys.shape[1]
    pooled = keys[:nb * r].view(nb, r, d).float().mean(dim=1).to(keys.dtype)
    xf = pooled.float()
    normed = (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps) * (1.0 + k_norm.float())).to(keys.dtype)
    starts = rope[:nb * r:r]
    cos, sin = starts[:, :rotary].float(), starts[:, rotary:2 * rotary].float()
    half = rotary // 2
    x = normed[:, :rotary].float()
    x1, x2 = x[:, :half], x[:, half:]
    rotated = torch.cat((x1 * cos[:, :half] - x2 * sin[:, :half], x2 * cos[:, half:] + x1 * sin[:, half:]), dim=-1)
    return torch.cat((rotated.to(keys.dtype), normed[:, rotary:]), dim=-1)


def indexer_cache_write(key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_pool: torch.Tensor,
                        rope_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The tokens' raw indexer keys and rotary cos | sin, zero-padded to the side pools' width, written at their
    slots (the contract: ``kv_cache_write`` of those rows)."""
    width = key_pool.shape[-1]
    if key.shape[-1] > width or 2 * cos.shape[-1] > width or cos.shape != sin.shape:
        raise ValueError(f"indexer_cache_write: keys of {key.shape[-1]} and angles of {cos.shape[-1]} + "
                         f"{sin.shape[-1]} do not fit side pools of width {width}")
    angles = torch.cat((cos, sin), dim=-1).to(key.dtype)
    kv_cache_write(F.pad(key, (0, width - key.shape[-1])).unsqueeze(1),
                   F.pad(angles, (0, width - angles.shape[-1])).unsqueeze(1), key_pool, rope_pool, slot_mapping)


def qsa_select(q: torch.Tensor, key_pool: torch.Tensor, rope_pool: torch.Tensor, k_norm: torch.Tensor, eps: float,
               cu_q: torch.Tensor, kv_lens: torch.Tensor, page_tables: torch.Tensor, ratio: int, block_topk: int,
               rotary: int) -> torch.Tensor:
    """The positions each query attends to (see the contract and the module docstring)."""
    t, _, d = q.shape
    page, r = key_pool.shape[1], ratio
    width = block_topk * r + r - 1
    if 2 * rotary > rope_pool.shape[-1] or d > key_pool.shape[-1] or rotary % 2:
        raise ValueError(f"qsa_select: pools of width {key_pool.shape[-1]} cannot hold keys of {d} and rotary "
                         f"{rotary}")
    sel = torch.full((t, width), -1, dtype=torch.int64, device=q.device)
    flat_k, flat_r = key_pool.flatten(0, 2), rope_pool.flatten(0, 2)
    for b, (q0, n_q, n_kv) in enumerate(_rows(cu_q, kv_lens)):
        if n_q == 0:
            continue
        slots = _positions(page_tables[b], n_kv, page)
        blocks = _block_keys(flat_k.index_select(0, slots)[:, :d], flat_r.index_select(0, slots), k_norm, eps, r,
                             rotary) if n_kv >= r else None
        for i in range(n_q):
            p = n_kv - n_q + i
            n_vis = (p + 1) // r
            if n_vis <= block_topk:   # every complete block is chosen
                chosen = torch.arange(n_vis * r, device=q.device)
            else:
                scores = torch.matmul(q[q0 + i].float(), blocks[:n_vis].float().transpose(-1, -2)).transpose(-1, -2)
                scores = torch.relu(scores).sum(dim=-1) / math.sqrt(d)
                top = scores.topk(block_topk, dim=0).indices
                chosen = (top[:, None] * r + torch.arange(r, device=q.device)[None, :]).flatten()
            tail = torch.arange(n_vis * r, p + 1, device=q.device)
            picked = torch.cat((chosen, tail))
            sel[q0 + i, :picked.numel()] = picked
    return sel


def qsa_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, sel: torch.Tensor, cu_q: torch.Tensor,
                  kv_lens: torch.Tensor, page_tables: torch.Tensor, scale: float,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over the positions its ``sel`` row lists (see the contract); with ``gate[T, Hq*D]``,
    times ``sigmoid(gate)`` in q.dtype."""
    t, hq, dh = q.shape
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    if hq % hkv:
        raise ValueError(f"qsa_attention: {hq} query heads are not a multiple of {hkv} KV heads")
    out = torch.empty_like(q)
    flat_k, flat_v = k_pool.flatten(0, 1), v_pool.flatten(0, 1)
    for b, (q0, n_q, n_kv) in enumerate(_rows(cu_q, kv_lens)):
        if n_q == 0:
            continue
        slots = _positions(page_tables[b], n_kv, page)
        k = flat_k.index_select(0, slots).float().repeat_interleave(hq // hkv, dim=1)   # [n_kv, Hq, D]
        v = flat_v.index_select(0, slots).float().repeat_interleave(hq // hkv, dim=1)
        rows = sel[q0:q0 + n_q]
        mask = torch.zeros((n_q, n_kv + 1), dtype=torch.bool, device=q.device)
        mask.scatter_(1, torch.where(rows >= 0, rows, n_kv), True)
        mask = mask[:, :n_kv]
        scores = torch.einsum("qhd,khd->hqk", q[q0:q0 + n_q].float(), k) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q0 + n_q] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    if gate is not None:
        if gate.shape != (t, hq * dh):
            raise ValueError(f"qsa_attention: gate {tuple(gate.shape)} must be [rows, Hq*D] = {(t, hq * dh)}")
        out = out * torch.sigmoid(gate.reshape(t, hq, dh).to(q.dtype))
    return out


OPS = [
    OpImpl(op="indexer_cache_write", name="torch_reference", fn=indexer_cache_write, priority=0),
    OpImpl(op="qsa_select", name="torch_reference", fn=qsa_select, priority=0),
    OpImpl(op="qsa_attention", name="torch_reference", fn=qsa_attention, priority=0),
]
