"""Torch reference ``segment_attention``: bidirectional attention inside each segment of a packed sequence (the
vision tower attends within one image, or one video frame, at a time).

Invariants: a token sees exactly the tokens of its own segment, every head on its own (no GQA); scores, softmax
and the weighted sum in fp32; the output rounded once to q.dtype. The segment bounds are read on the host (this
reference synchronises once); queries are taken in blocks so that one call holds at most about
``QUERY_BLOCK x segment length`` scores per head.
"""

from __future__ import annotations

import torch
from ninfer.ops.registry import OpImpl

QUERY_BLOCK = 1024


def check_bounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> list[int]:
    """The segment bounds read on the host, after checking the shapes and that they cover the T tokens."""
    t_len = q.shape[0]
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"segment_attention: q, k, v must be [T, H, D] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != t_len or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"segment_attention: cu_seqlens {cu[:8]}... must start at 0, never decrease and end at "
                         f"T = {t_len}")
    return cu


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    cu = check_bounds(q, k, v, cu_seqlens)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a, b in zip(cu, cu[1:], strict=False):
        if a == b:
            continue
        ks = k[a:b].float().transpose(0, 1)          # [H, L, D]
        vs = v[a:b].float().transpose(0, 1)
        for s in range(a, b, QUERY_BLOCK):
            e = min(b, s + QUERY_BLOCK)
            qs = q[s:e].float().transpose(0, 1)      # [H, l, D]
            p = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
            out[s:e] = (p @ vs).transpose(0, 1)
    return out.to(q.dtype)


OPS = [OpImpl(op="segment_attention", name="torch_reference", fn=segment_attention, priority=0)]
