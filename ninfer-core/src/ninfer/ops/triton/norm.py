"""Triton unit-offset RMSNorms (weight = the scale's offset from 1) and the embedding gather fused with one.

Ops: ``rms_norm_unit_offset``, ``embed_rms_norm_unit_offset``, ``add_rms_norm_unit_offset``.

Invariants (those of :mod:`ninfer.ops.reference.norm`, kept cast for cast):
- Statistics in fp32: ``inv = rsqrt(sum(x^2) / N + eps)`` per row of the last dim (:func:`inv_rms`, shared with
  the kernels of other RMSNorm variants and fused norms, so they reduce a row alike).
- ``rms_norm_unit_offset``: ``(x * inv) * (1 + w)`` in fp32, one rounding to x.dtype.
- ``add_rms_norm_unit_offset``: the residual sum is rounded to x.dtype first and *that* value is normalised, so
  the residual stream equals an unfused add and the output equals the norm of it.
- A row is held whole in registers (BLOCK_N = next power of two >= N), several rows per program when N is
  small; rows never interact, so results do not depend on how rows are grouped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2, pdl, pdl_wait


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[M, N] view (a copy only if the layout cannot be viewed) with a unit last-dim stride."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 or n == 1 else t2.contiguous()


def row_config(n: int) -> dict:
    """Launch shape for rows of N elements held whole in registers: BLOCK_M rows of BLOCK_N per program, warps."""
    block_n = next_pow2(n)
    block_m = max(1, min(64, 4096 // block_n))
    elems = block_m * block_n
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=16 if elems >= 16384 else 8 if elems >= 8192 else 4)


@triton.jit
def inv_rms(xf, N: tl.constexpr, eps):
    """``rsqrt(sum(x^2) / N + eps)`` per row of fp32 values ``xf[rows, BLOCK]`` (masked columns 0)."""
    return tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)


@triton.jit
def unit_offset_norm_rows(xf, inv, w):
    """``rms_norm_unit_offset`` of fp32 values ``xf[rows, B]`` given each row's ``inv`` (:func:`inv_rms`) and the
    weight's fp32 values ``w[B]``: ``(x * inv) * (1 + w)`` in fp32, before the one rounding to x.dtype (shared
    with fused kernels that normalise a row in pieces with one ``inv``)."""
    return (xf * inv[:, None]) * (1.0 + w[None, :])


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, M, eps, stride_x, stride_y, N: tl.constexpr, GROUPS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    xf = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = inv_rms(xf, N, eps)
    if GROUPS == 1:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = unit_offset_norm_rows(xf, inv, w)
    else:   # row r uses weight slice r % GROUPS (the same expression, a per-row weight)
        w = tl.load(w_ptr + (rows % GROUPS)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = (xf * inv[:, None]) * (1.0 + w)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["tok_ptr"])
def _embed_rms_norm_kernel(tok_ptr, table_ptr, w_ptr, y_ptr, rows_ptr, M, V, eps, stride_t, stride_y, stride_r,
                           N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr,
                           PDL: tl.constexpr):
    # The rows are gathered by token id and normalised as _rms_norm_kernel normalises them (same blocks, same
    # reduction): normed is bit for bit rms_norm_unit_offset(table[tokens]). The norm weight is a parameter: read
    # before the wait.
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    mask = rm[:, None] & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    # Ids outside [0, V) are a caller's bug (the engine checks ids on entry): clamped, they cannot fault the device.
    tok = tl.minimum(tl.maximum(tl.load(tok_ptr + rows64, mask=rm, other=0), 0), V - 1)
    x = tl.load(table_ptr + tok[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
    tl.store(rows_ptr + rows64[:, None] * stride_r + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    y = unit_offset_norm_rows(xf, inv_rms(xf, N, eps), w)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, res_ptr, M, eps, stride_x, stride_r, stride_y, stride_res,
                         N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    res = cast(x + r, res_ptr.dtype.element_ty, INTERP)  # the rounded sum: both outputs derive from it
    tl.store(res_ptr + rows64[:, None] * stride_res + cols[None, :], res, mask=mask)
    xf = res.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = unit_offset_norm_rows(xf, inv_rms(xf, N, eps), w)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty, INTERP), mask=mask)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim scaled by ``1 + weight``; ``weight[N]`` is the offset from 1."""
    return rms_norm_groups(x, weight, x.shape[-1], eps)


def rms_norm_groups(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """``rms_norm_unit_offset`` of each consecutive ``group`` elements of the last dim, each group scaled by
    ``1 + `` its own slice of ``weight`` (same shape as that dim); ``group`` = the whole dim is the plain norm.
    Each group is normalised exactly as the plain norm normalises a row (one statistic, one rounding), so an
    architecture's grouped norms (per-stream, per-head) reuse this kernel."""
    launch_ok(x)
    n = x.shape[-1]
    if group < 1 or n % group or weight.shape != (n,):
        raise ValueError(f"rms norm: last dim {n} and weight {tuple(weight.shape)} do not split into groups of "
                         f"{group}")
    x2 = as_rows(x, group)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m:
        cfg = row_config(group)
        _rms_norm_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            x2, weight.contiguous(), y, m, eps, x2.stride(0), y.stride(0), N=group, GROUPS=n // group,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], INTERP=INTERPRET, num_warps=cfg["num_warps"], **pdl(x2))
    return y.view(x.shape)


def embed_rms_norm_unit_offset(tokens: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_unit_offset(rows), rows)`` for ``rows = table[tokens]``, one launch (the reference's gather +
    norm). A page-locked host table beside CUDA tokens is read in place over the bus (unified addressing: the
    kernel loads its rows through the table's mapped pointer, so a graph captures the gather too)."""
    launch_ok(tokens)
    host_table = tokens.device.type == "cuda" and table.device.type == "cpu"
    if host_table and not table.is_pinned():
        raise ValueError("embed_rms_norm_unit_offset: a host-memory table must be page-locked (pinned) for the "
                         "device to read it")
    if tokens.dim() != 1 or tokens.dtype != torch.int64 or (tokens.device != table.device and not host_table):
        raise ValueError(f"embed_rms_norm_unit_offset: tokens must be int64 [T] on {table.device}, got "
                         f"{tokens.dtype} {tuple(tokens.shape)} on {tokens.device}")
    if table.dim() != 2 or weight.shape != (table.shape[1],) or weight.device != tokens.device:
        raise ValueError(f"embed_rms_norm_unit_offset: table {tuple(table.shape)} and norm weight "
                         f"{tuple(weight.shape)} on {weight.device} do not match ([V, N] and [N] on "
                         f"{tokens.device})")
    m, n = tokens.shape[0], table.shape[1]
    y = torch.empty((m, n), dtype=table.dtype, device=tokens.device)
    rows = torch.empty((m, n), dtype=table.dtype, device=tokens.device)
    if m:
        if host_table and table.stride(1) != 1:
            raise ValueError("embed_rms_norm_unit_offset: a host-memory table must have contiguous rows")
        table2 = table if table.stride(1) == 1 else table.contiguous()
        w = weight.contiguous()
        # The kernel reads the norm weight before its PDL wait: a weight the wrapper just copied was written by the
        # launch right before, so then no PDL.
        launch = pdl(tokens) if w is weight else {"PDL": False}
        cfg = row_config(n)
        _embed_rms_norm_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            tokens, table2, w, y, rows, m, table.shape[0], eps, table2.stride(0), y.stride(0),
            rows.stride(0), N=n, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], INTERP=INTERPRET,
            num_warps=cfg["num_warps"], **launch)
    return y, rows


def add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm_unit_offset(x + residual), x + residual)``; inputs are not modified."""
    launch_ok(x)
    n = x.shape[-1]
    x2, r2 = as_rows(x, n), as_rows(residual, n)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m:
        cfg = row_config(n)
        _add_rms_norm_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            x2, r2, weight.contiguous(), y, res, m, eps, x2.stride(0), r2.stride(0), y.stride(0), res.stride(0),
            N=n, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], INTERP=INTERPRET, num_warps=cfg["num_warps"], **pdl(x2))
    return y.view(x.shape), res.view(x.shape)


OPS = [
    OpImpl(op="rms_norm_unit_offset", name="triton", fn=rms_norm_unit_offset, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="embed_rms_norm_unit_offset", name="triton", fn=embed_rms_norm_unit_offset, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="add_rms_norm_unit_offset", name="triton", fn=add_rms_norm_unit_offset, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
]
