"""bf16 / fp16 decode products of 2 to 16 rows on the tensor cores (``NINFER_GEMV_TC=1``, a candidate).

Why: :func:`ninfer.ops.triton.linear.linear` streams a weight through the CUDA cores, one multiply-add per weight
element and row, so from a few rows on a large weight it runs out of issue slots and the reference's cuBLAS GEMM
takes the call (:data:`~ninfer.ops.triton.linear.MAX_ROW_BYTES`). cuBLAS reads the weight near the copy rate, but its
kernels do not overlap their launch with the previous kernel's tail (no PDL) and add split-K reduce launches for
the narrow projections: in a verify step (k + 1 rows a sequence) and a decode step of 2-16 sequences that is a
launch gap per projection. Here the weight tile is the A operand of ``tl.dot`` straight from memory and x^T the B
operand (``[BK, 8]``, or ``[BK, 16]`` from nine rows on; rows past M zero), so the products cost the tensor cores
next to nothing; split-K over about 264 programs fills the device and the fp32 partials are added by the last
program of each output block (:mod:`~ninfer.ops.triton._splitk`, no second launch); the kernel follows the PDL
protocol. Up to 16 rows covers a 16-token DFlash block's verify and a verify of two sequences at k = 7. As the
quantized tensor-core GEMVs, it can form a block's pre-norm in every program (``NORM``: ``add_rms_norm_unit_offset``
of x and the residual, stored by row block 0's programs) and end in SwiGLU where the partials are added, so a verify
step's norm, gate/up projection and activation are one launch. Measured in a 9B verify and decode step it is slower
than cuBLAS at 4 and 8 rows (docs/benchmarks.md), so it stays off.

Exactness: a bf16 (fp16) product is exact in fp32; sums run in the tensor cores' fp32 accumulation, then in fp32
across K runs in split order, then one rounding to x's dtype: the ``U_TC`` bound of the quantized tensor-core GEMVs.
A row's result does not depend on the other rows of the call for a given launch shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton._common import INTERPRET, l2_prefetch, l2_prefetch_aligned, pdl, pdl_wait
from ninfer.ops.triton._splitk import plan, store_out, sum_partials
from ninfer.ops.triton.quant_gemv_tc import inv_rms, split_count
from ninfer.ops.triton.quant_gemv_tc8 import x_step
from ninfer.switches import env_switch

#: Whether ``linear`` and ``logits`` run 2 to :data:`MAX_ROWS` rows of a weight the CUDA-core GEMV leaves to the
#: reference on this kernel (``NINFER_GEMV_TC`` ``0`` or ``1``, read once): a candidate until timed in a decode and
#: a verify step, off.
ENABLED = env_switch("NINFER_GEMV_TC", False)
#: Whether each program asks L2 for its whole weight run before the PDL wait (``NINFER_GEMV_TC_L2_PREFETCH`` ``0`` or
#: ``1``, read once; ``gemv_tc(l2_prefetch=None)``), so the weight stream starts while the previous kernel finishes,
#: as the CUDA-core GEMV's first tile does: a candidate until timed, off.
L2_PREFETCH = env_switch("NINFER_GEMV_TC_L2_PREFETCH", False)
#: Most rows of x (the B operand's columns, padded to 8, or to 16 above 8).
MAX_ROWS = 16
# Weight rows a program and K elements a step: [128, 128] bf16 tiles, 32 KB a step (the q4 kernel's bytes a step).
_BN, _BK = 128, 128
LAUNCH_OPTIONS = {"num_warps": 4}


@triton.jit(do_not_specialize=["M", "TPS", "S"])
def _tc_kernel(x_ptr, w_ptr, y_ptr, p_ptr, cnt_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, eps, M, N, OUT, K, TPS, S, sx, sw,
               sy, sp, sr, sh, sro, BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, SPLIT: tl.constexpr,
               REDUCE: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr, L2PF: tl.constexpr,
               INTERP: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)               # in-bounds rows: only the store is masked
    m2 = tl.arange(0, MP)[:, None]
    k2 = tl.arange(0, BK)[None, :]
    xoff = tl.minimum(m2, M - 1) * sx + k2          # rows past M repeat row M - 1, masked to 0
    roff = tl.minimum(m2, M - 1) * sr + k2
    xmask = (m2 < M) & (k2 >= 0)
    nstore = xmask & ((m2 * 0 + pid) == 0)          # row block 0's programs store the normed rows over their K run
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, tl.cdiv(K, BK))
    # The run's bytes of every row asked of L2 while the previous kernel finishes (weights are never written).
    run = tl.maximum(tl.minimum(t1 * BK, K) - t0 * BK, 0) * 2
    l2_prefetch(w_ptr + r * sw + t0 * BK, tl.zeros((BN,), dtype=tl.int32) + run, L2PF, INTERP)
    pdl_wait(PDL)
    inv = tl.zeros((MP, 1), dtype=tl.float32)
    if NORM:
        inv = inv_rms(x_ptr, r_ptr, ro_ptr.dtype.element_ty, M, K, eps, sx, sr, MP, 512, INTERP)[:, None]
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    for t in range(t0, t1):
        lane = t * BK + k2
        w = tl.load(w_ptr + r[:, None] * sw + lane, mask=lane < K, other=0.0)                 # [BN, BK]
        xv = x_step(x_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, inv, xoff + t * BK, roff + t * BK, lane,
                    xmask & (lane < K), nstore, sh, sro, M, K, MP, NORM, INTERP)             # [MP, BK]
        if INTERP:
            acc += tl.dot(w.to(tl.float32), tl.trans(xv.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(xv))
    store_out(acc, y_ptr, p_ptr, cnt_ptr, x_ptr, n, nm, pid, sid, S, sp, sy, M, N, OUT, BN, MP, SPLIT, REDUCE, SWIGLU,
              INTERP)


def takes(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv_tc` can take ``x2 @ weight.T``: 1 to :data:`MAX_ROWS` rows, bf16 or fp16 for both,
    row-contiguous, on CUDA (or the interpreter)."""
    return (x2.dim() == 2 and weight.dim() == 2 and x2.dtype == weight.dtype
            and x2.dtype in (torch.bfloat16, torch.float16) and 1 <= x2.shape[0] <= MAX_ROWS
            and x2.shape[1] == weight.shape[1] and x2.stride(1) == 1 and weight.stride(1) == 1
            and x2.device == weight.device and (x2.device.type == "cuda" or INTERPRET))


def gemv_tc(x2: torch.Tensor, weight: torch.Tensor, *, norm: tuple | None = None, swiglu: bool = False,
            out_dtype: torch.dtype | None = None, split: int | None = None,
            in_kernel_sum: bool = True, l2_prefetch: bool | None = None) -> torch.Tensor:
    """``x2[M, K] @ weight[N, K].T`` rounded to x2's dtype, stored as ``out_dtype`` (default x2's). ``norm =
    (residual2, norm_weight, eps, normed_out, residual_out)``: x2 is first replaced by its
    ``add_rms_norm_unit_offset`` with residual2 (formed in every program), stored to the given ``[M, K]`` outputs.
    ``swiglu``: weight is ``[2I, K]`` (gate rows, then up rows) and the result ``silu_and_mul`` of the product,
    ``[M, I]``, formed where the partials are added. ``split``: K runs (default: :func:`quant_gemv_tc.split_count`'s
    ``fill``); ``in_kernel_sum``: the partials added by the last program of each output block (else by the second
    kernel; the same bits). ``l2_prefetch`` (default :data:`L2_PREFETCH`): each program asks L2 for its weight run
    before the PDL wait, where the alignment holds (a 16-byte aligned weight, row stride and K); the same bits either
    way. A ``ValueError`` when :func:`takes` refuses."""
    if not takes(x2, weight):
        raise ValueError(f"tensor-core gemv: cannot take {tuple(x2.shape)} {x2.dtype} rows with a "
                         f"{tuple(weight.shape)} {weight.dtype} weight")
    m, k = x2.shape
    n = weight.shape[0]
    if swiglu and n % 2:
        raise ValueError(f"tensor-core gemv with SwiGLU: the weight has {n} rows, not [2I, K]")
    n_out = n // 2 if swiglu else n
    y = torch.empty((m, n_out), dtype=out_dtype or x2.dtype, device=x2.device)
    if n == 0:
        return y
    steps = triton.cdiv(k, _BK)
    programs = triton.cdiv(n, _BN)
    sp = plan(x2, y, n, steps, programs, _BN, split_count(programs, steps, "fill") if split is None else split,
              swiglu=swiglu, in_kernel_sum=in_kernel_sum)
    r2, nw, eps, hn, ro = norm or (x2, x2, 0.0, x2, x2)
    kw = {} if INTERPRET else dict(LAUNCH_OPTIONS)
    # A row's run ends at K, so K's bytes must be aligned as the base and the row stride are.
    l2 = (L2_PREFETCH if l2_prefetch is None else l2_prefetch) and l2_prefetch_aligned(
        weight.data_ptr(), weight.stride(0) * weight.element_size(), k * weight.element_size())
    _tc_kernel[(programs, sp.runs)](
        x2, weight, y, sp.part, sp.part if sp.counters is None else sp.counters, r2, nw, hn, ro, float(eps), m, n,
        n_out, k, sp.steps_per_run, sp.runs, x2.stride(0), weight.stride(0), y.stride(0),
        sp.part.stride(0) if sp.partials else 0, r2.stride(0), hn.stride(0), ro.stride(0), BN=_BN, BK=_BK,
        MP=8 if m <= 8 else 16,
        SPLIT=sp.partials, REDUCE=sp.counters is not None, SWIGLU=swiglu, NORM=norm is not None, L2PF=l2,
        INTERP=INTERPRET, **pdl(x2), **kw)
    if sp.partials and sp.counters is None:
        sum_partials(sp.part, y, x2, swiglu)
    return y
