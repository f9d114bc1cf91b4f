"""Torch reference RMSNorm variants of Qwen3.5.

Invariants (all statistics in fp32, eps inside the rsqrt):
- ``rms_norm``: zero-centred weight, ``fp32(x) * rsqrt(mean(x^2) + eps) * (1 + fp32(w))`` cast once to x.dtype.
- ``embed_rms_norm``: ``rms_norm`` of the gathered embedding rows, which are returned too (the residual stream).
- ``add_rms_norm``: ``new_residual = x + residual`` rounded to x.dtype first; ``y`` normalises exactly that
  rounded sum, so the residual stream and the normed value agree with an unfused add followed by rms_norm.
- ``gated_rms_norm``: the GDN output norm; the normalised value is rounded to x.dtype *before* the (plain,
  not 1+w) weight multiply, the gate's SiLU is fp32, and the result is rounded to x.dtype. This cast order is
  Qwen3_5RMSNormGated's and changes bf16 results, so it is kept exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.reference.activation import silu_and_mul
from ninfer.ops.reference.linear import linear
from ninfer.ops.registry import OpImpl


def _normalise_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim; ``weight[N]`` is the offset from 1."""
    return (_normalise_fp32(x, eps) * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; inputs are not modified."""
    new_residual = (x + residual).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(cast_x(norm(x)) * weight) * silu(fp32(gate))`` cast to x.dtype; norm over the last dim."""
    n = _normalise_fp32(x, eps).to(x.dtype)
    # weight * n uses torch's type promotion (bf16*bf16 stays bf16), matching the model's module.
    return ((n * weight) * F.silu(gate.float())).to(x.dtype)


def embed_rms_norm(tokens: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(rows), rows)`` for ``rows = table[tokens]``: the embedding and the first pre-norm."""
    rows = table.index_select(0, tokens)
    return rms_norm(rows, norm_weight, eps), rows


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(linear(normed, weight), normed, new_residual)`` with ``(normed, new_residual) = add_rms_norm(...)``."""
    normed, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight), normed, new_residual


def add_rms_norm_swiglu(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(silu_and_mul(y), normed, new_residual)`` for ``(y, normed, new_residual) = add_rms_norm_linear(...)``."""
    if gate_up.shape[0] % 2:
        raise ValueError(f"add_rms_norm_swiglu: gate_up has {gate_up.shape[0]} rows, not [2I, N]")
    y, normed, new_residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up)
    return silu_and_mul(y), normed, new_residual


OPS = [
    OpImpl(op="add_rms_norm_swiglu", name="torch_reference", fn=add_rms_norm_swiglu, priority=0),
    OpImpl(op="rms_norm", name="torch_reference", fn=rms_norm, priority=0),
    OpImpl(op="embed_rms_norm", name="torch_reference", fn=embed_rms_norm, priority=0),
    OpImpl(op="add_rms_norm_linear", name="torch_reference", fn=add_rms_norm_linear, priority=0),
    OpImpl(op="add_rms_norm", name="torch_reference", fn=add_rms_norm, priority=0),
    OpImpl(op="gated_rms_norm", name="torch_reference", fn=gated_rms_norm, priority=0),
]
