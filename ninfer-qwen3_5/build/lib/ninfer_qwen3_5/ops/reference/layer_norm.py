"""Torch reference ``layer_norm``: LayerNorm over the last dim with weight and bias (the vision tower's norms).

Invariants: statistics (mean, biased variance) and the affine map in fp32; one rounding to x.dtype at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.registry import OpImpl


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"layer_norm: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must be [{n}]")
    return F.layer_norm(x.float(), (n,), weight.float(), bias.float(), eps).to(x.dtype)


OPS = [OpImpl(op="layer_norm", name="torch_reference", fn=layer_norm, priority=0)]
