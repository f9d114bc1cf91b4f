"""Torch reference ``linear`` (CPU/CUDA, any float dtype).

Invariant: ``linear(x, w) == x @ w.T`` with no bias, output in x's dtype. torch's own GEMM accumulates bf16
inputs in fp32 on both CPU and CUDA, which satisfies "at least the input precision"; only the output is
rounded to x.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.registry import OpImpl


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x[..., in] @ weight[out, in].T -> [..., out]`` in x.dtype; a differing weight dtype is promoted."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: x has {x.shape[-1]} input features, weight expects {weight.shape[-1]}")
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    # Mixed dtypes (e.g. bf16 weights with fp32 activations on CPU): compute in the wider type so no
    # precision below either operand is used, then return x's dtype as the contract says.
    wide = torch.promote_types(x.dtype, weight.dtype)
    return F.linear(x.to(wide), weight.to(wide)).to(x.dtype)


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head: ``linear(x, weight)`` (rounded to x.dtype) as fp32."""
    return linear(x, weight).float()


OPS = [OpImpl(op="linear", name="torch_reference", fn=linear, priority=0),
       OpImpl(op="logits", name="torch_reference", fn=logits, priority=0)]
