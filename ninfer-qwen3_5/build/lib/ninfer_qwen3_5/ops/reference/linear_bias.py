"""Torch reference ``linear_bias``: ``x @ weight.T + bias``, the bias added before the output's one rounding.

Invariants: computed in the wider of the dtypes of x, weight and bias (torch's addmm: the bias joins the product's
accumulation), then cast to x.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.registry import OpImpl


def linear_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_bias: x [..., {x.shape[-1]}], weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} do not fit (weight [out, in], bias [out])")
    wide = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), bias.dtype)
    return F.linear(x.to(wide), weight.to(wide), bias.to(wide)).to(x.dtype)


OPS = [OpImpl(op="linear_bias", name="torch_reference", fn=linear_bias, priority=0)]
