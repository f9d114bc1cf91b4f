"""Torch reference unit-offset RMSNorm ops (the weight stores the scale's offset from 1) and their fusions.

Invariants (all statistics in fp32, eps inside the rsqrt):
- ``rms_norm_unit_offset``: ``fp32(x) * rsqrt(mean(x^2) + eps) * (1 + fp32(w))`` cast once to x.dtype.
- ``embed_rms_norm_unit_offset``: the norm of the gathered embedding rows, which are returned too (the residual
  stream).
- ``add_rms_norm_unit_offset``: ``new_residual = x + residual`` rounded to x.dtype first; ``y`` normalises exactly
  that rounded sum, so the residual stream and the normed value agree with an unfused add followed by the norm.
"""

from __future__ import annotations

import torch

from ninfer.ops.reference.activation import silu_and_mul
from ninfer.ops.reference.linear import linear
from ninfer.ops.registry import OpImpl


def rms_normalise_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``fp32(x) * rsqrt(mean(x^2) + eps)`` over the last dim, unrounded (shared by every RMSNorm variant)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim scaled by ``1 + weight``; ``weight[N]`` is the offset from 1."""
    return (rms_normalise_fp32(x, eps) * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm_unit_offset(x + residual), x + residual)``; inputs are not modified."""
    new_residual = (x + residual).to(x.dtype)
    return rms_norm_unit_offset(new_residual, weight, eps), new_residual


def embed_rms_norm_unit_offset(tokens: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_unit_offset(rows), rows)`` for ``rows = table[tokens]``: the embedding and the first pre-norm.
    A table in host memory beside GPU tokens is gathered on the host (the ids' copy waits for the stream)."""
    if table.device != tokens.device:
        rows = table.index_select(0, tokens.to(table.device)).to(tokens.device)
        return rms_norm_unit_offset(rows, norm_weight.to(tokens.device), eps), rows
    rows = table.index_select(0, tokens)
    return rms_norm_unit_offset(rows, norm_weight, eps), rows


def add_rms_norm_unit_offset_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                    weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(linear(normed, weight), normed, new_residual)`` with ``(normed, new_residual) =
    add_rms_norm_unit_offset(...)``."""
    normed, new_residual = add_rms_norm_unit_offset(x, residual, norm_weight, eps)
    return linear(normed, weight), normed, new_residual


def add_rms_norm_unit_offset_swiglu(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                    gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(silu_and_mul(y), normed, new_residual)`` for ``(y, normed, new_residual) =
    add_rms_norm_unit_offset_linear(...)``."""
    if gate_up.shape[0] % 2:
        raise ValueError(f"add_rms_norm_unit_offset_swiglu: gate_up has {gate_up.shape[0]} rows, not [2I, N]")
    y, normed, new_residual = add_rms_norm_unit_offset_linear(x, residual, norm_weight, eps, gate_up)
    return silu_and_mul(y), normed, new_residual


OPS = [
    OpImpl(op="add_rms_norm_unit_offset_swiglu", name="torch_reference", fn=add_rms_norm_unit_offset_swiglu,
           priority=0),
    OpImpl(op="rms_norm_unit_offset", name="torch_reference", fn=rms_norm_unit_offset, priority=0),
    OpImpl(op="embed_rms_norm_unit_offset", name="torch_reference", fn=embed_rms_norm_unit_offset, priority=0),
    OpImpl(op="add_rms_norm_unit_offset_linear", name="torch_reference", fn=add_rms_norm_unit_offset_linear,
           priority=0),
    OpImpl(op="add_rms_norm_unit_offset", name="torch_reference", fn=add_rms_norm_unit_offset, priority=0),
]
