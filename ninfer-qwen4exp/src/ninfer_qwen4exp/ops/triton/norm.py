"""Triton norms of Qwen4-Exp: ``rms_norm_unit_offset_grouped`` (the per-stream norms of the hyper-connections and
PLE) and ``gated_rms_norm_sigmoid`` (the GDN output norm with a sigmoid gate).

Invariants (those of :mod:`ninfer_qwen4exp.ops.reference.norm`, kept cast for cast):
- ``rms_norm_unit_offset_grouped``: the bank ``[T, G*N]`` is read as ``T*G`` rows of N (row r is group ``r % G`` of
  token ``r // G``), each normalised by core's norm kernel (:func:`ninfer.ops.triton.norm.rms_norm_groups`: core's
  statistic and expression) with its group's slice of the weight; one rounding.
- ``gated_rms_norm_sigmoid``: Qwen3.5's gated-norm kernel (:mod:`ninfer_qwen3_5.ops.triton.gated_norm`) with the
  sigmoid gate ``1 / (1 + exp(-g))`` in fp32.
"""

from __future__ import annotations

import torch
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import KERNEL_DTYPES
from ninfer.ops.triton.norm import rms_norm_groups
from ninfer_qwen3_5.ops.triton.gated_norm import launch_gated_norm


def rms_norm_unit_offset_grouped(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """``rms_norm_unit_offset`` of each consecutive ``group`` of the last dim, scaled by ``1 + weight``: core's norm
    kernel with a weight slice per group."""
    return rms_norm_groups(x, weight, group, eps)


def gated_rms_norm_sigmoid(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(cast_x(norm(x)) * weight) * sigmoid(fp32(gate))`` cast to x.dtype; norm over the last dim."""
    return launch_gated_norm(x, gate, weight, eps, sigmoid=True)


OPS = [
    OpImpl(op="rms_norm_unit_offset_grouped", name="triton", fn=rms_norm_unit_offset_grouped,
           devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="gated_rms_norm_sigmoid", name="triton", fn=gated_rms_norm_sigmoid, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
]
