"""Torch reference norms of Qwen4-Exp: the per-group unit-offset RMSNorm (hyper-connection and PLE norms over the
residual streams) and the GDN output norm with a sigmoid gate.

Invariants: statistics in fp32 with eps inside the rsqrt (core's :func:`~ninfer.ops.reference.norm.
rms_normalise_fp32`); ``rms_norm_unit_offset_grouped`` rounds once; ``gated_rms_norm_sigmoid`` keeps the cast order
of the checkpoint's module (normalised value rounded to x.dtype, times the plain weight, times the fp32 sigmoid of
the gate, rounded), exactly as Qwen3.5's SiLU-gated ``gated_rms_norm``; its reference lives beside that one in
ninfer-qwen3_5, whose ``gdn_decode`` ends with it for a ``sigmoid_gate`` layer, and is registered here.
"""

from __future__ import annotations

import torch
from ninfer.ops.reference.norm import rms_normalise_fp32
from ninfer.ops.registry import OpImpl
from ninfer_qwen3_5.ops.reference.gated_norm import gated_rms_norm_sigmoid  # the GDN decode step's too


def rms_norm_unit_offset_grouped(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """``rms_norm_unit_offset`` of each consecutive ``group`` of the last dim, scaled by ``1 + weight``."""
    n = x.shape[-1]
    if group < 1 or n % group or weight.shape != (n,):
        raise ValueError(f"rms_norm_unit_offset_grouped: last dim {n} and weight {tuple(weight.shape)} do not split "
                         f"into groups of {group}")
    grouped = rms_normalise_fp32(x.reshape(*x.shape[:-1], n // group, group), eps).reshape(x.shape)
    return (grouped * (1.0 + weight.float())).to(x.dtype)


OPS = [
    OpImpl(op="rms_norm_unit_offset_grouped", name="torch_reference", fn=rms_norm_unit_offset_grouped, priority=0),
    OpImpl(op="gated_rms_norm_sigmoid", name="torch_reference", fn=gated_rms_norm_sigmoid, priority=0),
]
