"""The op this plugin adds: ``llama_rms_norm``, its contract and its torch reference implementation.

Core's ``rms_norm_unit_offset`` scales by ``(1 + w)`` in fp32 and rounds once; Llama's RMSNorm rounds the
normalised value to the activation dtype first and then multiplies by the plain weight. Other arithmetic is
another contract (a name says what it computes), registered here because only this plugin's models call it.
A Triton kernel would be one more ``OpImpl`` of the same op at a priority above 0, on ``cuda``.
"""

from __future__ import annotations

import torch
from ninfer.ops.contracts import OpContract
from ninfer.ops.registry import OpImpl

CONTRACTS = (
    OpContract("llama_rms_norm", "llama_rms_norm(x[..., N], weight[N], eps) -> [..., N]",
               "Llama's RMSNorm: n = fp32(x) * rsqrt(mean(fp32(x)^2) + eps) over the last dim, rounded to x.dtype; "
               "the result is weight * n (weight in x.dtype, the product rounded to x.dtype)."),
)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * normed


OPS = (OpImpl(op="llama_rms_norm", name="torch_reference", fn=llama_rms_norm, priority=0),)
