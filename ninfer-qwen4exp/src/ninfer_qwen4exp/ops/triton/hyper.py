"""Triton hyper-connection steps (``hc_act``, ``hc_mix``, ``hc_write``): each one launch where the torch expression
is several.

Invariants (those of :mod:`ninfer_qwen4exp.ops.reference.hyper`, kept cast for cast):
- ``hc_mix``, program (token, tile of H): for each stream k in order, ``s = x.dtype(sigmoid(z_k))``, ``p =
  x.dtype(s * xn_k)``, summed in fp32; ``u = x.dtype(sum / n)``. The programs of tile 0 also store
  ``inject = 2 * x.dtype(sigmoid(x.dtype(g / n)))``. The sigmoid is ``1 / (1 + exp(-z))`` in fp32, so a value may
  differ from torch's in its last fp32 bit before the rounding to x.dtype.
- ``hc_act``, program (tile of rows): ``y = x / (1 + exp(-x))`` for ``x = x.dtype(d / n)``, rounded once.
- ``hc_write``, program (token, tile of n*H): ``x_k + x.dtype(inject_k * y)``, rounded to x.dtype.
- Banks and outputs are row-contiguous ``[T, n*H]``; any T, n, H.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2

from ninfer_qwen4exp.ops.reference.hyper import check_bank


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["T"])
def _act_kernel(d_ptr, y_ptr, T, stride_d, stride_y, R: tl.constexpr, STREAMS: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_R: tl.constexpr, INTERP: tl.constexpr):
    DT: tl.constexpr = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_R)
    m = (rows[:, None] < T) & (cols[None, :] < R)
    rows64 = rows.to(tl.int64)
    x = cast(tl.load(d_ptr + rows64[:, None] * stride_d + cols[None, :], mask=m, other=0.0).to(tl.float32) / STREAMS,
             DT, INTERP).to(tl.float32)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], cast(x / (1.0 + tl.exp(-x)), DT, INTERP), mask=m)


@triton.jit(do_not_specialize=["H"])
def _mix_kernel(z_ptr, xn_ptr, g_ptr, u_ptr, inj_ptr, H, stride_z, stride_x, stride_g, stride_u, stride_i,
                STREAMS: tl.constexpr, HAS_G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                INTERP: tl.constexpr):
    DT: tl.constexpr = u_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    jm = j < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(STREAMS):
        z = tl.load(z_ptr + t * stride_z + k * H + j, mask=jm, other=0.0).to(tl.float32)
        xn = tl.load(xn_ptr + t * stride_x + k * H + j, mask=jm, other=0.0).to(tl.float32)
        s = cast(_sigmoid(z), DT, INTERP).to(tl.float32)
        acc += cast(s * xn, DT, INTERP).to(tl.float32)
    tl.store(u_ptr + t * stride_u + j, cast(acc / STREAMS, DT, INTERP), mask=jm)
    if HAS_G:
        if tl.program_id(1) == 0:
            s_ = tl.arange(0, BLOCK_S)
            sm = s_ < STREAMS
            g = tl.load(g_ptr + t * stride_g + s_, mask=sm, other=0.0).to(tl.float32)
            scaled = cast(g / STREAMS, DT, INTERP).to(tl.float32)
            tl.store(inj_ptr + t * stride_i + s_, cast(_sigmoid(scaled), DT, INTERP).to(tl.float32) * 2.0, mask=sm)


@triton.jit(do_not_specialize=["H"])
def _write_kernel(x_ptr, y_ptr, a_ptr, out_ptr, H, stride_x, stride_y, stride_a, stride_o, STREAMS: tl.constexpr,
                  BLOCK: tl.constexpr, INTERP: tl.constexpr):
    DT: tl.constexpr = out_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < STREAMS * H
    k = c // H
    x = tl.load(x_ptr + t * stride_x + c, mask=cm, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * stride_y + (c - k * H), mask=cm, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t * stride_a + k, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + c, cast(x + cast(a * y, DT, INTERP).to(tl.float32), DT, INTERP), mask=cm)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def hc_act(d: torch.Tensor, streams: int) -> torch.Tensor:
    """``silu(d / n)`` (the contract), one launch; ``d`` may be a row-strided view ``[T, R]``."""
    launch_ok(d)
    if d.dim() != 2 or streams < 1:
        raise ValueError(f"hc_act: d must be [T, R] and the streams positive, got {tuple(d.shape)} and {streams}")
    d = _rows(d)
    t, r = d.shape
    y = torch.empty((t, r), dtype=d.dtype, device=d.device)
    if t:
        block_r = next_pow2(r)
        block_t = max(1, min(16, 4096 // block_r))
        _act_kernel[(triton.cdiv(t, block_t),)](d, y, t, d.stride(0), y.stride(0), R=r, STREAMS=streams,
                                                BLOCK_T=block_t, BLOCK_R=block_r, INTERP=INTERPRET)
    return y


def hc_mix(z: torch.Tensor, xn: torch.Tensor, g: torch.Tensor | None,
           streams: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(u[T, H], inject[T, n] or None)`` (the contract), one launch."""
    launch_ok(xn)
    h = check_bank("hc_mix", xn, streams)
    t = xn.shape[0]
    if z.shape != xn.shape or (g is not None and g.shape != (t, streams)):
        raise ValueError(f"hc_mix: z {tuple(z.shape)}, xn {tuple(xn.shape)} and g "
                         f"{None if g is None else tuple(g.shape)} do not match [T, n*H] and [T, n]")
    z, xn = _rows(z), _rows(xn)
    u = torch.empty((t, h), dtype=xn.dtype, device=xn.device)
    inject = None if g is None else torch.empty((t, streams), dtype=g.dtype, device=g.device)
    if t:
        block = min(1024, next_pow2(h))
        gg, ii = (u, u) if g is None else (_rows(g), inject)
        _mix_kernel[(t, triton.cdiv(h, block))](
            z, xn, gg, u, ii, h, z.stride(0), xn.stride(0), gg.stride(0), u.stride(0), ii.stride(0),
            STREAMS=streams, HAS_G=g is not None, BLOCK_H=block, BLOCK_S=next_pow2(streams), INTERP=INTERPRET)
    return u, inject


def hc_write(x: torch.Tensor, y: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """``x_k + inject_k * y`` for every stream (the contract), one launch. The product is rounded before the sum,
    as the contract's two ops round: the build turns off fp fusion, which would make it one fma (one rounding)."""
    launch_ok(x)
    t, streams = inject.shape
    h = check_bank("hc_write", x, streams)
    if y.shape != (t, h) or x.shape[0] != t:
        raise ValueError(f"hc_write: x {tuple(x.shape)}, y {tuple(y.shape)} and inject {tuple(inject.shape)} do "
                         f"not match [T, n*H], [T, H] and [T, n]")
    x, y, inject = _rows(x), _rows(y), _rows(inject)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t:
        block = min(2048, next_pow2(streams * h))
        _write_kernel[(t, triton.cdiv(streams * h, block))](
            x, y, inject, out, h, x.stride(0), y.stride(0), inject.stride(0), out.stride(0), STREAMS=streams,
            BLOCK=block, INTERP=INTERPRET, **({} if INTERPRET else {"enable_fp_fusion": False}))
    return out


OPS = [
    OpImpl(op="hc_act", name="triton", fn=hc_act, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="hc_mix", name="triton", fn=hc_mix, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="hc_write", name="triton", fn=hc_write, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10),
]
