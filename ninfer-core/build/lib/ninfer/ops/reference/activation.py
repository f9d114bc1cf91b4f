"""Torch reference ``silu_and_mul`` (the SwiGLU activation of dense MLPs and MoE experts).

Invariant: ``out = silu(x[..., :I]) * x[..., I:]`` computed in fp32 and rounded once to x.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.registry import OpImpl


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x[..., 2I] -> [..., I]``: gate half first, then the up half."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is not even")
    half = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)


OPS = [OpImpl(op="silu_and_mul", name="torch_reference", fn=silu_and_mul, priority=0)]
