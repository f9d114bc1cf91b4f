"""Torch reference of the PLE n-gram hash and of the host-table gather.

Invariants:
- ``ngram_hash`` is a pure function of each token's window (its n most recent ids): chunk boundaries, batching
  and resuming change nothing as long as the caller builds the same windows.
- A window never reaches across an EOS: the tokens before the latest EOS strictly before the current token count as
  EOS (the current token itself may be an EOS, which ends its segment only for the tokens after it).
- ``ple_gather`` reads only the requested rows of the table; with the table in host memory and ids on a CUDA device
  it copies the ids to the host, gathers there (into pinned memory) and copies the rows back, so the device never
  holds the table.
"""

from __future__ import annotations

import torch
from ninfer.ops.registry import OpImpl


def ngram_hash(windows: torch.Tensor, multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor,
               eos: int, heads_per_ngram: int) -> torch.Tensor:
    """``ids[T, G]`` of each window's n-grams of orders 2..n (module docstring and the contract)."""
    t, n = windows.shape
    g = (n - 1) * heads_per_ngram
    if multipliers.shape != (n,) or sizes.shape != (g,) or offsets.shape != (g,):
        raise ValueError(f"ngram_hash: windows of {n} tokens need {n} multipliers and {g} head sizes/offsets, got "
                         f"{tuple(multipliers.shape)}, {tuple(sizes.shape)}, {tuple(offsets.shape)}")
    w = windows.long()
    eos_t = torch.full_like(w[:, 0], eos)
    shifted = [w[:, n - 1]]
    cut = torch.zeros_like(w[:, 0], dtype=torch.bool)   # an EOS lies within the window's last s tokens (excluding t)
    for s in range(1, n):
        cut = cut | (w[:, n - 1 - s] == eos)
        shifted.append(torch.where(cut, eos_t, w[:, n - 1 - s]))
    mult = multipliers.to(w.device).long()
    blocks = []
    mixed = shifted[0] * mult[0]
    for m in range(2, n + 1):
        mixed = torch.bitwise_xor(mixed, shifted[m - 1] * mult[m - 1])
        lo = (m - 2) * heads_per_ngram
        heads = slice(lo, lo + heads_per_ngram)
        size, offset = sizes[heads].to(w.device).long(), offsets[heads].to(w.device).long()
        blocks.append(torch.remainder(mixed[:, None], size[None, :]) + offset[None, :])
    return torch.cat(blocks, dim=1)


def ple_gather(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``table[ids]`` as ``[T, G * D]`` in ``dtype`` on ``ids.device``."""
    t, g = ids.shape
    if table.device == ids.device:
        rows = table.index_select(0, ids.reshape(-1))
    else:
        host_ids = ids.reshape(-1).to(table.device)
        pin = ids.device.type == "cuda" and table.device.type == "cpu"
        staged = torch.empty((t * g, table.shape[1]), dtype=table.dtype, pin_memory=pin)
        torch.index_select(table, 0, host_ids, out=staged)
        rows = staged.to(ids.device, non_blocking=pin)
    return rows.to(dtype).reshape(t, g * table.shape[1])


OPS = [
    OpImpl(op="ngram_hash", name="torch_reference", fn=ngram_hash, priority=0),
    OpImpl(op="ple_gather", name="torch_reference", fn=ple_gather, priority=0),
]
