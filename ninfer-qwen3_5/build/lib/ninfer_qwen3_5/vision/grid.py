"""Per-patch index tables of the vision tower, from the patch grids alone (no weights).

A medium's patch grid is ``(t, h, w)``: ``t`` temporal patches (frames, after the temporal patch pairs two
video frames; 1 for an image), each ``h x w`` spatial patches. Its ``t * h * w`` input rows come frame by frame,
and inside a frame in *merge-block order*: the ``m x m`` patches that the merger folds into one embedding are
consecutive (``m`` = spatial_merge_size), blocks in row-major order. Patch ``p`` of a frame therefore sits at

    row = (p // (m*m*(w/m))) * m + (p // m) % m,    col = ((p // (m*m)) % (w/m)) * m + p % m.

From these coordinates (repeated for every frame):

- :func:`rotary_tables`: the 2-D axial RoPE of the tower's attention: a head of width D rotates its first D/2
  dims by ``row * f`` and the last D/2 by ``col * f`` with the D/4 frequencies ``f_i = theta^(-4i/D)``, laid out
  ``cat(cat(row f, col f), cat(row f, col f))`` (the rotate-half pairing of core's ``rope`` op). Angles and
  cos/sin in fp32.
- :func:`position_taps`: the learned ``side x side`` position table resampled to the ``h x w`` grid by
  bilinear interpolation with aligned corners: source coordinate ``row * (side - 1) / max(h - 1, 1)`` (likewise
  for columns), four taps clamped to the table, weights the products of the per-axis linear weights, in fp32.
- :func:`segment_bounds`: attention segments, one per frame (``h * w`` rows each).

Invariant: ``h`` and ``w`` are multiples of ``m`` (:func:`check_grid` refuses anything else, naming it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Grid = tuple[int, int, int]


def check_grid(grid: Sequence[int], merge: int, what: str = "grid") -> Grid:
    """``grid`` as a checked ``(t, h, w)`` of positive ints with h and w multiples of ``merge``."""
    g = tuple(grid)
    if len(g) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in g):
        raise ValueError(f"{what} {g!r} must be three integers (t, h, w) >= 1")
    if g[1] % merge or g[2] % merge:
        raise ValueError(f"{what} {g!r}: h and w must be multiples of the spatial merge size {merge}")
    return g  # type: ignore[return-value]


def patch_coordinates(grid: Grid, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) int64 ``[t*h*w]`` of every input row of one medium (module docstring)."""
    t, h, w = grid
    p = torch.arange(h * w, dtype=torch.int64)
    blocks_w = w // merge
    row = (p // (merge * merge * blocks_w)) * merge + (p // merge) % merge
    col = ((p // (merge * merge)) % blocks_w) * merge + p % merge
    return row.repeat(t), col.repeat(t)


def rotary_tables(grids: Sequence[Grid], merge: int, head_dim: int, theta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 ``[N, head_dim]`` for the rows of ``grids`` in order (module docstring)."""
    quarter = head_dim // 4
    inv = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.int64).float() / (head_dim // 2)))
    if inv.shape[0] != quarter:
        raise ValueError(f"vision rotary: head_dim {head_dim} must be a multiple of 4")
    rows, cols = zip(*(patch_coordinates(g, merge) for g in grids), strict=True)
    angles = torch.cat((torch.cat(rows).float()[:, None] * inv, torch.cat(cols).float()[:, None] * inv), dim=-1)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps per target index on one axis of length ``size`` into ``side`` table entries, and their
    weights (aligned corners; taps clamped to the table, where the clamped tap's weight is 0 anyway)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    low = src.floor()
    frac = src - low
    taps = torch.stack((low.long(), low.long() + 1), dim=-1).clamp(0, side - 1)
    return taps, torch.stack((1 - frac, frac), dim=-1)


def position_taps(grids: Sequence[Grid], merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64 ``[N, 4]`` into the flattened ``side x side`` table, weights fp32 ``[N, 4]``) for the rows
    of ``grids`` in order: row n's position embedding is ``sum_k table[indices[n, k]] * weights[n, k]``."""
    idx, wts = [], []
    for g in grids:
        row, col = patch_coordinates(g, merge)
        h_taps, h_w = _axis_taps(row, g[1], side)
        w_taps, w_w = _axis_taps(col, g[2], side)
        idx.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        wts.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))
    return torch.cat(idx), torch.cat(wts)


def segment_bounds(grids: Sequence[Grid]) -> list[int]:
    """cu_seqlens of the tower's attention: one segment per frame of each medium, in order."""
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu
