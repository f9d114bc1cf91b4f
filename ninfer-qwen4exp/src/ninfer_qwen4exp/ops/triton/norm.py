"""Triton norms of Qwen4-Exp: ``rms_norm_unit_offset_grouped`` (the per-stream norms of the hyper-connections and
PLE) and ``gated_rms_norm_sigmoid`` (the GDN output norm with a sigmoid gate).

Invariants (those of :mod:`ninfer_qwen4exp.ops.reference.norm`, kept cast for cast):
- ``rms_norm_unit_offset_grouped``: the bank ``[T, G*N]`` is read as ``T*G`` rows of N (row r is group ``r % G`` of
  token ``r // G``), each normalised as core's ``rms_norm_unit_offset`` normalises a row (core's statistic and
  expression, :mod:`ninfer.ops.triton.norm`) with its group's slice of the weight; one rounding.
- ``gated_rms_norm_sigmoid``: Qwen3.5's gated-norm kernel (:mod:`ninfer_qwen3_5.ops.triton.gated_norm`) with the
  sigmoid gate ``1 / (1 + exp(-g))`` in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, pdl, pdl_wait
from ninfer.ops.triton.norm import as_rows, inv_rms, row_config
from ninfer_qwen3_5.ops.triton.gated_norm import launch_gated_norm


@triton.jit(do_not_specialize=["M"])
def _grouped_norm_kernel(x_ptr, w_ptr, y_ptr, M, G, eps, stride_x, stride_y, N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    xf = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + (rows % G)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = (xf * inv_rms(xf, N, eps)[:, None]) * (1.0 + w)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty, INTERP), mask=mask)


def rms_norm_unit_offset_grouped(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """``rms_norm_unit_offset`` of each consecutive ``group`` of the last dim, scaled by ``1 + weight``."""
    launch_ok(x)
    n = x.shape[-1]
    if group < 1 or n % group or weight.shape != (n,):
        raise ValueError(f"rms_norm_unit_offset_grouped: last dim {n} and weight {tuple(weight.shape)} do not split "
                         f"into groups of {group}")
    x2 = as_rows(x, group)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m:
        cfg = row_config(group)
        _grouped_norm_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            x2, weight.contiguous(), y, m, n // group, eps, x2.stride(0), y.stride(0), N=group,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], INTERP=INTERPRET, num_warps=cfg["num_warps"], **pdl(x2))
    return y.view(x.shape)


def gated_rms_norm_sigmoid(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(cast_x(norm(x)) * weight) * sigmoid(fp32(gate))`` cast to x.dtype; norm over the last dim."""
    return launch_gated_norm(x, gate, weight, eps, sigmoid=True)


OPS = [
    OpImpl(op="rms_norm_unit_offset_grouped", name="triton", fn=rms_norm_unit_offset_grouped,
           devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="gated_rms_norm_sigmoid", name="triton", fn=gated_rms_norm_sigmoid, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
]
