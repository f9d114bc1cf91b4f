"""Triton ``linear`` for decode-sized inputs: a streaming GEMV.

Same contract as :func:`ninfer.ops.reference.linear.linear` (``x @ w.T``, fp32 accumulation, output in x's dtype).
Only the shapes where it beats cuBLAS take this path (:func:`use_gemv`); everything else -- prefill, several rows of
a large weight, mixed dtypes -- is the reference's ``F.linear``, except that with ``NINFER_GEMV_TC=1`` 2-16 rows of a
large weight take the tensor-core GEMV of :mod:`~ninfer.ops.triton.linear_tc` (a candidate).

Why: with one to a few rows a GEMM is a weight stream, and what decides its speed is how many bytes are in flight.
cuBLAS picks split-K kernels plus a reduce kernel for the narrow ones (the MoE router + shared-expert projection,
~5 MB) and leaves HBM bandwidth unused on the large ones (tools/gpu_gemv_sweep.py, docs/dev/perf-log.md). Here each
program owns BN output features and streams their rows in ``[BN, BK]`` tiles, BK = min(K, 4096): one tile for every
projection with at most 4096 inputs, so no load waits on arithmetic, and thousands of such programs keep the memory
system full. The first tile is requested before the PDL wait (:func:`~ninfer.ops.triton.
_common.pdl_wait`), so it streams while the previous kernel finishes; later tiles are prefetched one ahead.

Per row ``m`` of x the program reduces ``w * x[m]`` over each tile in fp32 and sums the tiles in K order: a row's
result does not depend on the other rows of the call, nor on M (rows are independent for a given weight).

``add_rms_norm_unit_offset_linear`` is the same kernel with a prologue (``NORM``): after the PDL wait every program
forms the block's pre-norm of the row from x, the residual and the norm weight (one tile: K <= 4096) and multiplies its
weight tile by that; program 0 stores the normed row and the new residual for the rest of the block. The norm's
launch (a launch gap at decode, twice per layer) is gone; what it adds is a few KB per program read from L2, which is
why it is taken for one row only (:data:`_NORM_BN`).

``logits`` (the LM head) is the same kernel storing fp32: each dot is rounded to x's dtype first, so the values are
``linear(x, w).float()``'s without the [T, V] cast launch (one more pass over the largest output of the step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.reference import linear as _reference
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton import activation as _activation
from ninfer.ops.triton import linear_tc
from ninfer.ops.triton import norm as _norm
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, next_pow2, pdl, pdl_wait

# Widest K tile (elements): [2, 4096] bf16 tiles are 16 KB, 64 weight elements per thread at 4 warps.
_TILE = 4096
# Each row costs a multiply-reduce of every weight tile on the CUDA cores, so with more rows cuBLAS's tensor-core
# kernels win. tools/gpu_gemv_sweep.py finds the crossover: the GEMV is faster for one row at every model shape,
# and for M rows while M * weight bytes stays under MAX_ROW_BYTES.
MAX_ROWS = 8
MAX_ROW_BYTES = 48 << 20
# add_rms_norm_unit_offset_linear takes the fused kernel for one row only, with 4 output rows per program (halving
# the programs that each re-form the norm): per tools/gpu_decode_fusion_sweep.py, one row at BN=4 beats the
# separate norm + GEMV at every model shape, BN=2 does not, and eight rows lose.
_NORM_BN = 4
# add_rms_norm_unit_offset_swiglu's rows per program: 2 gate + 2 up rows, the registers (and program count) of
# _NORM_BN.
_SWIGLU_BN = 2


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, eps, M, N, K, NI, sx_m, sw_n, sy_m, sr_m, sh_m,
                 sro_m, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_TILE: tl.constexpr,
                 EXACT: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, INTERP: tl.constexpr,
                 PDL: tl.constexpr):
    # SWIGLU (ONE_TILE only): output feature n is silu(g_n) * u_n of weight rows n (gate) and NI + n (up), each dot
    # rounded to y's dtype first, as linear followed by silu_and_mul rounds them.
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    n_in = tl.where(nm, n, 0)   # in-bounds rows: the weight load needs no row mask, only the store does
    kk = tl.arange(0, BK)
    rows = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    w_ptrs = w_ptr + n_in[:, None] * sw_n + kk[None, :]
    # The first weight tile is requested before the PDL wait: it streams while the previous kernel finishes.
    if EXACT:  # K == BK: unmasked, fully vectorised loads
        w_next = tl.load(w_ptrs)
    else:
        w_next = tl.load(w_ptrs, mask=kk[None, :] < K, other=0.0)
    if SWIGLU:
        u_next = tl.load(w_ptrs + NI * sw_n, mask=kk[None, :] < K, other=0.0)
    if NORM:  # the norm's weight: a parameter, so also before the wait
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    if ONE_TILE:  # K <= BK: straight-line code, one load per operand
        w = w_next.to(tl.float32)
        if SWIGLU:
            wu = u_next.to(tl.float32)
        for m in tl.static_range(BM):
            x_row = x_ptr + tl.minimum(M - 1, m) * sx_m + kk
            if EXACT:
                xm = tl.load(x_row).to(tl.float32)
            else:
                xm = tl.load(x_row, mask=kk < K, other=0.0).to(tl.float32)
            if NORM:
                # add_rms_norm_unit_offset of row m (its roundings: the sum to x.dtype, the normed value to
                # x.dtype), formed by every program from the whole row; program 0 stores both for the rest of the
                # block.
                rm = tl.load(r_ptr + tl.minimum(M - 1, m) * sr_m + kk, mask=kk < K, other=0.0).to(tl.float32)
                res = cast(xm + rm, ro_ptr.dtype.element_ty, INTERP)
                rf = res.to(tl.float32)
                hm = cast((rf * tl.rsqrt(tl.sum(rf * rf, 0) / K + eps)) * (1.0 + nw), h_ptr.dtype.element_ty, INTERP)
                keep = (kk < K) & (kk * 0 + m < M) & (kk * 0 + tl.program_id(0) == 0)
                tl.store(ro_ptr + m * sro_m + kk, res, mask=keep)
                tl.store(h_ptr + m * sh_m + kk, hm, mask=keep)
                xm = hm.to(tl.float32)
            acc = tl.where(rows[:, None] == m, acc + tl.sum(w * xm[None, :], 1)[None, :], acc)
            if SWIGLU:
                acc_u = tl.where(rows[:, None] == m, acc_u + tl.sum(wu * xm[None, :], 1)[None, :], acc_u)
    else:
        for k0 in range(0, K, BK):
            w = w_next.to(tl.float32)
            # Next tile in flight while this one is reduced (masked off past K: no traffic).
            w_next = tl.load(w_ptrs + (k0 + BK), mask=(k0 + BK + kk[None, :]) < K, other=0.0)
            for m in tl.static_range(BM):
                # Rows past M (BM is M rounded up to a power of two) re-read row M-1; their results are not stored.
                xm = tl.load(x_ptr + tl.minimum(M - 1, m) * sx_m + k0 + kk, mask=(k0 + kk) < K,
                             other=0.0).to(tl.float32)
                acc = tl.where(rows[:, None] == m, acc + tl.sum(w * xm[None, :], 1)[None, :], acc)
    y_ptrs = y_ptr + rows[:, None] * sy_m + n[None, :]
    if SWIGLU:
        g = cast(acc, y_ptr.dtype.element_ty, INTERP).to(tl.float32)
        u = cast(acc_u, y_ptr.dtype.element_ty, INTERP).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * u
    # Rounded to x's dtype (linear's rounding), then stored as y's dtype (fp32 for ``logits``: exact).
    y = cast(acc, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, y, mask=(rows[:, None] < M) & nm[None, :])


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` takes the GEMV kernel (else the reference)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    nbytes = weight.numel() * weight.element_size()
    return (x.device.type == weight.device.type and (x.device.type == "cuda" or INTERPRET)
            and x.dtype == weight.dtype and x.dtype in KERNEL_DTYPES and 1 <= rows <= MAX_ROWS
            and weight.dim() == 2 and weight.stride(1) == 1 and x.stride(-1) == 1
            and (rows == 1 or rows * nbytes <= MAX_ROW_BYTES))


def gemv(x2: torch.Tensor, weight: torch.Tensor, *, norm: tuple | None = None, swiglu: bool = False,
         block_n: int | None = None, warps: int = 4, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x2[M, K] @ weight[N, K].T`` with the kernel (``block_n``/``warps``: launch-shape overrides for sweeps).
    ``norm = (residual2, norm_weight, eps, normed_out, residual_out)``: x2 is first replaced by
    add_rms_norm_unit_offset(x2, residual2) (K must fit one tile), whose two results program 0 stores to the given
    [M, K] outputs. ``swiglu``: weight is ``[2I, K]`` (gate rows, then up rows) and the result ``silu_and_mul`` of the
    product, ``[M, I]`` (K must fit one tile). ``out_dtype`` (default x's): the dtype stored, after rounding to x's."""
    m, k = x2.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    bk = min(next_pow2(k), _TILE)
    bn = block_n or (2 if m == 1 else 4)
    kw = {} if INTERPRET else {"num_warps": warps}
    if norm is None:
        r2 = nw = h = ro = x2
        eps = 0.0
    else:
        r2, nw, eps, h, ro = norm
        assert k <= bk, "the norm prologue needs the whole row in one tile"
    assert not swiglu or (k <= bk and weight.shape[0] == 2 * n), "swiglu needs [2I, K] weights and K in one tile"
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x2, weight, y, r2, nw, h, ro, float(eps), m, n, k, n, x2.stride(0), weight.stride(0), y.stride(0),
        r2.stride(0), h.stride(0), ro.stride(0), BM=next_pow2(m), BN=bn, BK=bk, ONE_TILE=k <= bk, EXACT=k == bk,
        NORM=norm is not None, SWIGLU=swiglu, INTERP=INTERPRET, **pdl(x2), **kw)
    return y


def _tensor_core_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x's rows as ``[M, K]`` where ``NINFER_GEMV_TC=1`` gives a call the GEMV refuses to the tensor-core GEMV
    (:mod:`~ninfer.ops.triton.linear_tc`: 2 to 16 rows), else None."""
    if not linear_tc.ENABLED or x.numel() == 0:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if linear_tc.takes(x2, weight) else None


def _fuses_on_tensor_cores(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a fused norm op's rows go to the tensor-core GEMV with its norm prologue: where ``linear`` would send
    the product there (``NINFER_GEMV_TC=1``, the CUDA-core GEMV refusing) and the residual is x's kind."""
    return (linear_tc.ENABLED and not use_gemv(x, weight) and _tensor_core_rows(x, weight) is not None
            and residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(-1) == 1)


def _tensor_core_norm(x, residual, norm_weight, eps, weight, swiglu: bool):
    """``(product, normed, new_residual)`` of a fused norm op in one tensor-core GEMV launch (SwiGLU: the product is
    ``silu_and_mul`` of it)."""
    n_in = x.shape[-1]
    x2, r2 = x.reshape(-1, n_in), residual.reshape(-1, n_in)
    normed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = linear_tc.gemv_tc(x2, weight, norm=(r2, norm_weight.contiguous(), eps, normed, new_residual), swiglu=swiglu)
    lead = x.shape[:-1]
    return y.view(*lead, y.shape[-1]), normed.view(*lead, n_in), new_residual.view(*lead, n_in)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x[..., in] @ weight[out, in].T -> [..., out]``: the GEMV for a few rows, else the reference."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: x has {x.shape[-1]} input features, weight expects {weight.shape[-1]}")
    if not use_gemv(x, weight):
        tc = _tensor_core_rows(x, weight)
        return _reference.linear(x, weight) if tc is None else linear_tc.gemv_tc(tc, weight).view(
            *x.shape[:-1], weight.shape[0])
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return gemv(x2, weight).view(*x.shape[:-1], weight.shape[0])


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(x, weight).float()``: for rows the GEMV takes, one kernel storing fp32 (at one row faster than
    cuBLAS even for a 1 GB LM head, tools/gpu_gemv_sweep.py)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"logits: x has {x.shape[-1]} input features, weight expects {weight.shape[-1]}")
    if not use_gemv(x, weight):
        tc = _tensor_core_rows(x, weight)
        if tc is not None:
            return linear_tc.gemv_tc(tc, weight, out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])
        return _reference.linear(x, weight).float()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return gemv(x2, weight, out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])


def add_rms_norm_unit_offset_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                    weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(linear(normed, weight), normed, new_residual)``: for one row, where the GEMV applies and the row fits
    one tile, one GEMV whose programs each form the row's add_rms_norm_unit_offset (a few KB from L2); else the
    Triton add_rms_norm_unit_offset followed by :func:`linear`."""
    n_in = x.shape[-1]
    if residual.shape != x.shape or norm_weight.shape != (n_in,):
        raise ValueError(f"add_rms_norm_unit_offset_linear: x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
                         f"norm weight {tuple(norm_weight.shape)}")
    rows = x.numel() // n_in if n_in else 0
    if rows > 1 and _fuses_on_tensor_cores(x, residual, weight):
        return _tensor_core_norm(x, residual, norm_weight, eps, weight, swiglu=False)
    if not (rows == 1 and use_gemv(x, weight) and n_in <= _TILE and residual.dtype == x.dtype
            and residual.stride(-1) == 1):
        normed, new_residual = _norm.add_rms_norm_unit_offset(x, residual, norm_weight, eps)
        return linear(normed, weight), normed, new_residual
    x2, r2 = x.reshape(-1, n_in), residual.reshape(-1, n_in)
    normed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = gemv(x2, weight, norm=(r2, norm_weight.contiguous(), eps, normed, new_residual), block_n=_NORM_BN)
    lead = x.shape[:-1]
    return y.view(*lead, weight.shape[0]), normed.view(*lead, n_in), new_residual.view(*lead, n_in)


def add_rms_norm_unit_offset_swiglu(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                    gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(silu_and_mul(linear(normed, gate_up)), normed, new_residual)``: for one row where the fused
    add_rms_norm_unit_offset_linear applies, one GEMV whose programs each compute gate row n and up row I + n and
    store the activation (no [1, 2I] intermediate, no silu_and_mul launch); else
    add_rms_norm_unit_offset_linear then silu_and_mul."""
    n_in = x.shape[-1]
    if gate_up.shape[0] % 2:
        raise ValueError(f"add_rms_norm_unit_offset_swiglu: gate_up has {gate_up.shape[0]} rows, not [2I, N]")
    rows = x.numel() // n_in if n_in else 0
    if (rows > 1 and residual.shape == x.shape and norm_weight.shape == (n_in,)
            and _fuses_on_tensor_cores(x, residual, gate_up)):
        return _tensor_core_norm(x, residual, norm_weight, eps, gate_up, swiglu=True)
    if not (rows == 1 and residual.shape == x.shape and norm_weight.shape == (n_in,) and use_gemv(x, gate_up)
            and n_in <= _TILE and residual.dtype == x.dtype and residual.stride(-1) == 1):
        y, normed, new_residual = add_rms_norm_unit_offset_linear(x, residual, norm_weight, eps, gate_up)
        return _activation.silu_and_mul(y), normed, new_residual
    x2, r2 = x.reshape(-1, n_in), residual.reshape(-1, n_in)
    normed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    act = gemv(x2, gate_up, norm=(r2, norm_weight.contiguous(), eps, normed, new_residual), swiglu=True,
               block_n=_SWIGLU_BN)
    lead = x.shape[:-1]
    return act.view(*lead, act.shape[-1]), normed.view(*lead, n_in), new_residual.view(*lead, n_in)


OPS = [OpImpl(op="linear", name="triton", fn=linear, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
              priority=10),
       OpImpl(op="logits", name="triton", fn=logits, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
              priority=10),
       OpImpl(op="add_rms_norm_unit_offset_linear", name="triton", fn=add_rms_norm_unit_offset_linear,
              devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10),
       OpImpl(op="add_rms_norm_unit_offset_swiglu", name="triton", fn=add_rms_norm_unit_offset_swiglu,
              devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10)]
