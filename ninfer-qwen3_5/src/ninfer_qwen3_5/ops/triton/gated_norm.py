"""Triton ``gated_rms_norm``: the Gated DeltaNet output norm, with the reference's cast chain.

Invariants (those of :mod:`ninfer_qwen3_5.ops.reference.gated_norm`, kept cast for cast):
- Statistics in fp32 with core's RMS statistic (:func:`ninfer.ops.triton.norm.inv_rms`).
- ``n = x * inv`` rounded to x.dtype; ``n * w`` rounded to torch's promoted dtype of (x, w) (bf16 * bf16 stays
  bf16, as in the model's module); times ``silu(fp32 gate)``; rounded to x.dtype.
- Rows are held whole in registers with core's norm launch shape (:func:`ninfer.ops.triton.norm.row_config`);
  rows never interact, so results do not depend on how rows are grouped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, TL_DTYPE, cast, launch_ok, pdl, pdl_wait
from ninfer.ops.triton.norm import as_rows, inv_rms, row_config


@triton.jit
def normed_weighted(xf, w, eps, N: tl.constexpr, X_DTYPE: tl.constexpr, NW_DTYPE: tl.constexpr,
                    INTERP: tl.constexpr):
    """The gated norms' ungated part of [rows, BLOCK_N] fp32 values of x (X_DTYPE): ``NW_DTYPE(X_DTYPE(x * inv) *
    w)`` as fp32."""
    n = cast(xf * inv_rms(xf, N, eps)[:, None], X_DTYPE, INTERP).to(tl.float32)
    return cast(n * w[None, :], NW_DTYPE, INTERP).to(tl.float32)


@triton.jit
def gated_norm_rows(xf, g, w, eps, N: tl.constexpr, X_DTYPE: tl.constexpr, NW_DTYPE: tl.constexpr,
                    INTERP: tl.constexpr, SIGMOID: tl.constexpr = False):
    """``gated_rms_norm`` of [rows, BLOCK_N] fp32 values of x (X_DTYPE) and gate g (masked columns 0), in fp32
    with the contract's two roundings (shared with ``gdn_decode``); SIGMOID: the gate is ``sigmoid(g)``, not
    ``silu(g)``."""
    nw = normed_weighted(xf, w, eps, N, X_DTYPE, NW_DTYPE, INTERP)
    if SIGMOID:
        out = nw * (1.0 / (1.0 + tl.exp(-g)))
    else:
        out = nw * (g / (1.0 + tl.exp(-g)))
    return out


@triton.jit(do_not_specialize=["M"])
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, M, eps, stride_x, GH, stride_g0, stride_g1, stride_y,
                           N: tl.constexpr, NW_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           INTERP: tl.constexpr, PDL: tl.constexpr, SIGMOID: tl.constexpr = False):
    """SIGMOID: the gate is ``sigmoid(fp32 gate)`` instead of ``silu`` (Qwen4-Exp's ``gated_rms_norm_sigmoid``)."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    xf = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Gate row r is head r % GH of token r // GH: a [T, H, N] gate may be a column view of a wider projection.
    g_rows = (rows64 // GH) * stride_g0 + (rows64 % GH) * stride_g1
    g = tl.load(g_ptr + g_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = gated_norm_rows(xf, g, w, eps, N, y_ptr.dtype.element_ty, NW_DTYPE, INTERP, SIGMOID)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty, INTERP), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(cast_x(norm(x)) * weight) * silu(fp32(gate))`` cast to x.dtype; norm over the last dim."""
    return launch_gated_norm(x, gate, weight, eps, sigmoid=False)


def launch_gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                      sigmoid: bool) -> torch.Tensor:
    """``gated_rms_norm`` with the SiLU gate, or with ``sigmoid`` a sigmoid gate (``(cast_x(norm(x)) * weight) *
    sigmoid(fp32(gate))``: Qwen4-Exp's ``gated_rms_norm_sigmoid``)."""
    launch_ok(x)
    n = x.shape[-1]
    x2 = as_rows(x, n)
    if gate.dim() == 3 and gate.stride(-1) == 1 and tuple(gate.shape) == tuple(x.shape):
        # [T, H, N] read in place by (token, head) strides: the GDN's z is a column view of the input
        # projection, which reshape could only flatten with a copy.
        g2, gh, sg0, sg1 = gate, gate.shape[1], gate.stride(0), gate.stride(1)
    else:
        g2 = as_rows(gate, n)
        gh, sg0, sg1 = 1, g2.stride(0), 0
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m:
        cfg = row_config(n)
        nw_dtype = TL_DTYPE[torch.promote_types(x.dtype, weight.dtype)]
        _gated_rms_norm_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            x2, g2, weight.contiguous(), y, m, eps, x2.stride(0), max(gh, 1), sg0, sg1, y.stride(0), N=n,
            NW_DTYPE=nw_dtype, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], INTERP=INTERPRET,
            num_warps=cfg["num_warps"], SIGMOID=sigmoid, **pdl(x2))
    return y.view(x.shape)


OPS = [OpImpl(op="gated_rms_norm", name="triton", fn=gated_rms_norm, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
