"""Torch reference ``mrope_cos_sin``: the multimodal-RoPE (MRoPE) cos/sin table, Qwen3.5's interleaved layout.

Invariants: frequency index i (0 <= i < R/2) takes its position from one axis of ``positions``; angle =
position * inv_freq[i] is formed in fp64 (exact for any int64 position below 2^53 up to one rounding) and cos/sin
are rounded once to fp32. HF and vLLM form the angle in fp32, which is off by up to ~position * 2^-24 radians; the
fp64 angle is the mathematically specified value. Axis of index i:
  * sections None: axis 0 (plain RoPE on positions[0]).
  * interleaved (Qwen3.5, sections (s_t, s_h, s_w)): H if i % 3 == 1 and i < 3 s_h; W if i % 3 == 2 and
    i < 3 s_w; otherwise T. For [11, 11, 10]: H = 1,4,..,31; W = 2,5,..,29; T = 0,3,..,30.
  * not interleaved (Qwen2-VL layout): the first s_t indices from T, the next s_h from H, the last s_w from W.
Output ``cos = cat(cos f, cos f)``, same for sin, shape [T, R]: the tables core's ``rope`` takes.
"""

from __future__ import annotations

import functools

import torch
from ninfer.ops.registry import OpImpl


def axis_of_frequency(half: int, sections: tuple[int, ...] | None, interleaved: bool) -> list[int]:
    """The position axis (0 = T, 1 = H, 2 = W) of each frequency index (module docstring)."""
    if sections is None:
        return [0] * half
    sections = tuple(int(s) for s in sections)
    if len(sections) != 3 or sum(sections) != half:
        raise ValueError(f"mrope_cos_sin: sections {sections} must be three sizes summing to R/2 = {half}")
    if interleaved:
        s_h, s_w = sections[1], sections[2]
        return [1 if (i % 3 == 1 and i < 3 * s_h) else 2 if (i % 3 == 2 and i < 3 * s_w) else 0
                for i in range(half)]
    return [0] * sections[0] + [1] * sections[1] + [2] * sections[2]


@functools.lru_cache(maxsize=64)
def axis_tensor(axes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Cached: building it is a host->device copy, which a CUDA graph capture may not contain (the first
    # call of a shape happens in the eager warm-up before capture).
    return torch.tensor(axes, dtype=torch.long, device=device)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, sections, interleaved: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, R] fp32 for ``positions[3, T]`` (or ``[T]`` / ``[1, T]`` when sections is None)."""
    half = inv_freq.shape[0]
    if positions.dim() == 1:
        positions = positions[None]
    axes = axis_of_frequency(half, sections, interleaved)
    if max(axes) >= positions.shape[0]:
        raise ValueError(f"mrope_cos_sin: sections need 3 position axes, got {positions.shape[0]}")
    axis = axis_tensor(tuple(axes), positions.device)
    # positions_per_freq[t, i] = positions[axis[i], t]
    pos = positions.index_select(0, axis).t().to(torch.float64)
    f = pos * inv_freq.to(device=positions.device, dtype=torch.float64)[None, :]
    f = torch.cat((f, f), dim=-1)
    return f.cos().float(), f.sin().float()


OPS = [OpImpl(op="mrope_cos_sin", name="torch_reference", fn=mrope_cos_sin, priority=0)]
