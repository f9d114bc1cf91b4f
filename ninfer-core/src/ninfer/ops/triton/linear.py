"""Triton ``linear`` for decode-sized inputs: a streaming GEMV, one weight tile per program.

Same contract as :func:`ninfer.ops.reference.linear.linear` (``x @ w.T``, fp32 accumulation, output in x's dtype).
Only the shapes where it beats cuBLAS take this path (:func:`use_gemv`); everything else -- prefill, the LM head,
mixed dtypes -- is the reference's ``F.linear``.

Why: with one to a few rows a GEMM is a weight stream, and what decides its speed is how many bytes are in flight.
cuBLAS picks split-K kernels plus a reduce kernel for the narrow ones (the MoE router + shared-expert projection,
~5 MB: 8.7 us, 17% of HBM bandwidth, measured on an H200) and ~77% of bandwidth on the 50 MB GDN projection. Here
every program loads its whole ``[BN, K]`` weight tile with one load (``BN * K <= _TILE`` elements, 16 KB in bf16):
no K loop, so no load waits on the previous one's arithmetic, and thousands of such programs keep the memory system
full from the first cycle.

Per row ``m`` of x the program reduces ``w * x[m]`` over K in fp32 (rows are independent: a row's result does not
depend on the other rows of the call, nor on M, for a given weight; the K tree is Triton's ``tl.sum``). K above
``_TILE`` (not a Qwen3.5 shape) loops over K in ``_TILE``-wide chunks, summing the chunks' partial dots in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.reference import linear as _reference
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, next_pow2

# Weight elements per program (16 KB in bf16; 32 per thread at 8 warps).
_TILE = 8192
# Rows up to which the GEMV is used: each row costs a [BN, K] multiply-reduce per program on the CUDA cores,
# so past a few rows cuBLAS's tensor-core kernels win.
MAX_ROWS = 4
# Weights above this size stay on cuBLAS: its large-N GEMV (the LM head, ~1 GB) already streams at copy bandwidth.
MAX_WEIGHT_BYTES = 256 << 20


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sx_m, sw_n, sy_m,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 INTERP: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    n_in = tl.where(nm, n, 0)   # in-bounds rows: the weight load needs no row mask, only the store does
    kk = tl.arange(0, BK)
    rows = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    w_ptrs = w_ptr + n_in[:, None] * sw_n + kk[None, :]
    for k0 in range(0, K, BK):
        if EVEN_K:
            w = tl.load(w_ptrs).to(tl.float32)
        else:
            km = (k0 + kk) < K
            w = tl.load(w_ptrs, mask=km[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(BM):
            # Rows past M (BM is M rounded up to a power of two) re-read row M-1; their results are not stored.
            xr = tl.minimum(M - 1, m)
            xm = tl.load(x_ptr + xr * sx_m + k0 + kk, mask=(k0 + kk) < K, other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :], 1)
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
        w_ptrs += BK
    y_ptrs = y_ptr + rows[:, None] * sy_m + n[None, :]
    tl.store(y_ptrs, cast(acc, y_ptr.dtype.element_ty, INTERP), mask=(rows[:, None] < M) & nm[None, :])


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` takes the GEMV kernel (else the reference)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.device.type == weight.device.type and (x.device.type == "cuda" or INTERPRET)
            and x.dtype == weight.dtype and x.dtype in KERNEL_DTYPES and 1 <= rows <= MAX_ROWS
            and weight.dim() == 2 and weight.stride(1) == 1 and x.stride(-1) == 1
            and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES)


def gemv(x2: torch.Tensor, weight: torch.Tensor, *, block_n: int | None = None, warps: int = 8) -> torch.Tensor:
    """``x2[M, K] @ weight[N, K].T`` with the kernel (``block_n``/``warps``: launch-shape overrides for sweeps)."""
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    bk = min(next_pow2(k), _TILE)
    bn = block_n or max(1, _TILE // bk)
    kw = {} if INTERPRET else {"num_warps": warps}
    _gemv_kernel[(triton.cdiv(n, bn),)](x2, weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
                                        BM=next_pow2(m), BN=bn, BK=bk, EVEN_K=k % bk == 0, INTERP=INTERPRET, **kw)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x[..., in] @ weight[out, in].T -> [..., out]``: the GEMV for a few rows, else the reference."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: x has {x.shape[-1]} input features, weight expects {weight.shape[-1]}")
    if not use_gemv(x, weight):
        return _reference.linear(x, weight)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return gemv(x2, weight).view(*x.shape[:-1], weight.shape[0])


OPS = [OpImpl(op="linear", name="triton", fn=linear, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
              priority=10)]
