"""Torch reference ``gated_rms_norm``: the Gated DeltaNet output norm of Qwen3.5 (``Qwen3_5RMSNormGated``).

Invariant: the normalised value (core's fp32 RMS statistic, :func:`~ninfer.ops.reference.norm.rms_normalise_fp32`)
is rounded to x.dtype *before* the (plain, not 1+w) weight multiply, the gate's SiLU is fp32, and the result is
rounded to x.dtype. This cast order is the checkpoint's module's and changes bf16 results, so it is kept exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.reference.norm import rms_normalise_fp32
from ninfer.ops.registry import OpImpl


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(cast_x(norm(x)) * weight) * silu(fp32(gate))`` cast to x.dtype; norm over the last dim."""
    n = rms_normalise_fp32(x, eps).to(x.dtype)
    # weight * n uses torch's type promotion (bf16*bf16 stays bf16), matching the model's module.
    return ((n * weight) * F.silu(gate.float())).to(x.dtype)


def gated_rms_norm_sigmoid(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``gated_rms_norm`` with a sigmoid gate: ``(cast_x(norm(x)) * weight) * sigmoid(fp32(gate))`` cast to x.dtype
    (the op is Qwen4-Exp's; ``gdn_decode`` of a ``sigmoid_gate`` layer ends with it)."""
    n = rms_normalise_fp32(x, eps).to(x.dtype)
    return ((n * weight) * torch.sigmoid(gate.float())).to(x.dtype)


OPS = [OpImpl(op="gated_rms_norm", name="torch_reference", fn=gated_rms_norm, priority=0)]
