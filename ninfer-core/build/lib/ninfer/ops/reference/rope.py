"""Torch reference ``rope``: NeoX rotate-half rotary embedding on the first R dims of each head.

Invariants: for pairs (j, j + R/2), j < R/2: ``y_j = x_j cos_j - x_{j+R/2} sin_j`` and
``y_{j+R/2} = x_{j+R/2} cos_{j+R/2} + x_j sin_{j+R/2}`` in fp32, cast to x.dtype; dims >= R are copied
bit-exactly. cos/sin ([T, R], usually cat(f, f) of the angles) broadcast over heads; how they are built
(plain positions, multimodal sections, scaling) is the architecture's, not this op's.
"""

from __future__ import annotations

import torch

from ninfer.ops.registry import OpImpl


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x[T, H, D]`` on its first R = cos.shape[-1] dims."""
    rot = cos.shape[-1]
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"rope: rotary dim {rot} must be even and <= head dim {x.shape[-1]}")
    half = rot // 2
    c = cos.float()[:, None, :]  # broadcast over heads
    s = sin.float()[:, None, :]
    xr = x[..., :rot].float()
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = torch.cat((x1 * c[..., :half] - x2 * s[..., :half],
                         x2 * c[..., half:] + x1 * s[..., half:]), dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)


OPS = [OpImpl(op="rope", name="torch_reference", fn=rope, priority=0)]
