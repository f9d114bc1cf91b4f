"""Decode-sized products with a q4 weight on the tensor cores: the dequant-GEMV's alternative for ``q4_g64_fp16``
weights and bf16 activations, up to :data:`MAX_ROWS` rows of x.

Why: the CUDA-core GEMV (:mod:`~ninfer.ops.triton.quant_gemv`) multiplies every decoded code by x on the CUDA cores
(a nibble extracted, converted and multiplied: about 16 instructions a weight byte in its sm_90 build), so it is
bound by instruction issue well before the H200's bandwidth (~7 instructions a byte at full speed). Here the codes
become exact bf16 values two at a time by integer tricks in inline PTX, and the tensor cores do the multiplying:
about 4.4 loop instructions a byte (``tools/sass_report.py qgemv``).

Per program: ``BN`` weight rows, ``GPI`` scale groups (64 lanes each) a K step; split-K over programs so that a
weight of few rows still fills the device.

- Decode: the base plane is read as uint16 (four nibbles, lanes ``4e .. 4e+3``). The PTX turns a 32-bit word into
  four bf16 pairs, each with one ``lop3`` (the nibble, xor 8, into the mantissa of the bf16 ``128 + code``) and one
  ``bf16x2`` fma (minus 136): exact, since every code is an integer of -8..7. Under the interpreter the same values
  come from plain integer ops.
- A = the codes ``[BN, 64 * GPI]`` straight from registers (Triton carries the dot-operand layout back through the
  join, permute and reshape to the load, so no layout conversion runs in the loop). Within a group the decode's
  lane order is ``k = c * 16 + e`` for physical lane ``4e + c``; x is loaded in its natural order and permuted the
  same way in registers.
- B = a block-diagonal x^T ``[64 * GPI, GPI * MP]``: column ``g * MP + m`` holds row m of x on group g's lanes and
  zeros elsewhere, so one dot yields every row's sum over each group. The fp16 group scale multiplies each group's
  sum in fp32, the groups are added after the loop.
- Split-K (``S > 1``, and always with SwiGLU): fp32 partials ``[S, M, N]``, added in the kernel by the program that
  arrives last at its output block (:mod:`~ninfer.ops.triton._splitk`: deterministic, no second launch); SwiGLU
  there too, from the rounded gate and up sums. ``S == 1`` rounds and stores in the same kernel.

Exactness: the weights are exactly the decoded ``code * scale``; products are exact (a 4-bit code times a bf16);
sums run in the tensor cores' fp32 accumulation (per dot) and in fp32 (scales, groups, partials): the bound of
tensor-core sums (tests/ops_triton/quant_cases.py ``U_TC``), not the CUDA-core GEMV's round-to-nearest one. A row's
result does not depend on the other rows of the call for a given launch shape (MP, GPI, BN and the split follow
from the row count, so a call's rows share them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.ops.triton._common import (
    INTERPRET,
    cast,
    l2_prefetch,
    l2_prefetch_aligned,
    next_pow2,
    pdl,
    pdl_wait,
)
from ninfer.ops.triton._quant import KernelWeight
from ninfer.ops.triton._splitk import plan, store_out, sum_partials
from ninfer.switches import env_switch

#: Most rows of x the tensor-core GEMV takes (x's rows are the B operand's columns, padded to MP).
MAX_ROWS = 8
#: Which decode GEMV the dense quantized ops run (``NINFER_QUANT_GEMV``, read once, like NINFER_PDL): ``auto`` (the
#: default) the tensor-core GEMVs where they were measured faster (:func:`ninfer.ops.triton.quant_linear.tc_module`
#: has the table), ``tc`` them wherever they take the call, ``cuda`` never (the CUDA-core GEMV and the GEMM).
MODE = os.environ.get("NINFER_QUANT_GEMV", "auto")
MODES = ("auto", "tc", "cuda")
if MODE not in MODES:
    raise ValueError(f"NINFER_QUANT_GEMV={MODE!r}: expected one of {', '.join(MODES)}")
# (BN, GPI) by MP: weight rows a program, scale groups a K step (GPI * MP >= 8, the tensor cores' narrowest N).
_SHAPES = {1: (128, 8), 2: (128, 4), 4: (128, 2), 8: (256, 2)}
# Programs to aim for with split-K: about two a streaming multiprocessor on the H200 (what fits at once: these
# kernels' shared memory allows two CTAs an SM).
_TARGET_PROGRAMS = 264
#: How the tensor-core GEMVs choose split-K (``NINFER_QUANT_SPLIT``, read once): ``fill`` (the default) at least
#: ``_TARGET_PROGRAMS`` programs; ``wave`` the split whose programs finish soonest in a model of whole waves
#: (:func:`split_count`); ``streamk`` q4 weights through :mod:`~ninfer.ops.triton.quant_gemv_streamk` (equal shares
#: of all (row block, K step) units, ``fill`` for the 8-bit kernels and where stream-K declines). Candidates until
#: timed in a decode step.
SPLIT_RULE = os.environ.get("NINFER_QUANT_SPLIT", "fill")
SPLIT_RULES = ("fill", "wave", "streamk")
if SPLIT_RULE not in SPLIT_RULES:
    raise ValueError(f"NINFER_QUANT_SPLIT={SPLIT_RULE!r}: expected one of {', '.join(SPLIT_RULES)}")
# The wave model's fixed cost of a program (launch, PDL wait, epilogue), in K steps.
_PROGRAM_COST_STEPS = 1
# Launch options of the tensor-core GEMVs on a GPU (Triton's default 3 pipeline stages); a sweep may change them.
LAUNCH_OPTIONS = {"num_warps": 4}
#: Whether the q4 tensor-core GEMV loads each program's first weight tile before the PDL wait by default
#: (``NINFER_QUANT_PREFETCH`` ``0`` or ``1``, read once; ``gemv_tc(prefetch=None)``): a candidate until timed in a
#: decode step, off.
PREFETCH = env_switch("NINFER_QUANT_PREFETCH", False)
#: Whether the tensor-core GEMVs (q4 and 8-bit) ask L2 for each program's whole weight run before the PDL wait by
#: default (``NINFER_QUANT_L2_PREFETCH`` ``0`` or ``1``, read once; ``gemv_tc(l2_prefetch=None)``): sm_90's bulk
#: prefetch, one instruction a weight row, no registers, the same values. A candidate until timed in a decode step,
#: off.
L2_PREFETCH = env_switch("NINFER_QUANT_L2_PREFETCH", False)


def split_count(programs: int, steps: int, rule: str | None = None, slots: int | None = None) -> int:
    """K runs for ``programs`` row blocks of ``steps`` K steps each (>= 1, every run non-empty); ``rule`` None is
    :data:`SPLIT_RULE`, ``slots`` None the programs that fit the device at once.

    ``fill``: enough runs for ``slots`` programs (no more runs than steps). ``wave``: the count that minimises
    ``ceil(programs * s / slots) * (cost + ceil(steps / s))``, the time of whole waves of ``slots`` programs that
    each pay a fixed ``cost`` and their steps; ties go to fewer runs (fewer partials to add). A split that spills
    a few programs into a second wave doubles its time in this model, where ``fill`` would take it."""
    rule = rule or SPLIT_RULE
    slots = slots or _TARGET_PROGRAMS
    if rule not in SPLIT_RULES:
        raise ValueError(f"split rule {rule!r}: expected one of {', '.join(SPLIT_RULES)}")
    if steps < 2:
        return 1
    if rule in ("fill", "streamk"):   # streamk: the row-block kernels' split where stream-K does not run
        s = max(1, min(steps, -(-slots // programs)))
    else:   # wave
        def cost(s: int) -> int:
            return -(-programs * s // slots) * (_PROGRAM_COST_STEPS + -(-steps // s))

        s = min(range(1, steps + 1), key=lambda s: (cost(s), s))
    tps = -(-steps // s)
    return -(-steps // tps)                                  # no empty runs

_ASM = tl.constexpr("""{
.reg .b32 t, one, m;
mov.b32 one, 0x3F803F80;
mov.b32 m, 0xC308C308;
lop3.b32 t, $4, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $0, t, one, m;
shr.u32 t, $4, 4;
lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $1, t, one, m;
shr.u32 t, $4, 8;
lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $2, t, one, m;
shr.u32 t, $4, 12;
lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $3, t, one, m;
}""")


@triton.jit
def _codes(h, INTERP: tl.constexpr):
    """uint16 elements ``h`` (four nibbles each) -> bf16 codes of nibble 0, 1, 2, 3 of every element."""
    if INTERP:
        v = h.to(tl.int32)
        c0 = (((v & 15) ^ 8) - 8).to(tl.float32).to(tl.bfloat16)
        c1 = ((((v >> 4) & 15) ^ 8) - 8).to(tl.float32).to(tl.bfloat16)
        c2 = ((((v >> 8) & 15) ^ 8) - 8).to(tl.float32).to(tl.bfloat16)
        c3 = ((((v >> 12) & 15) ^ 8) - 8).to(tl.float32).to(tl.bfloat16)
        return c0, c1, c2, c3
    else:
        return tl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r", [h],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=2)


@triton.jit
def inv_rms(x_ptr, r_ptr, res_ty, M, K, eps, sx, sr, MP: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """``rsqrt(mean(res^2) + eps)`` of each row's rounded ``res = x + r`` (the block's pre-norm), ``[MP]`` fp32."""
    m = tl.arange(0, MP)[:, None]
    row = tl.minimum(m, M - 1)
    ss2 = tl.zeros((MP,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)[None, :]
        km = (k < K) & (m < M)
        xv = tl.load(x_ptr + row * sx + k, mask=km, other=0.0).to(tl.float32)
        rv = tl.load(r_ptr + row * sr + k, mask=km, other=0.0).to(tl.float32)
        res = cast(xv + rv, res_ty, INTERP).to(tl.float32)
        ss2 += tl.sum(res * res, 1)
    return tl.rsqrt(ss2 / K + eps)


@triton.jit
def lanes(M, sx, GPI: tl.constexpr, MP: tl.constexpr):
    """The index tensors of a q4 tensor-core program: a weight tile's ``[GPI, 16]`` uint16 offsets (``g3``, ``e3``),
    x's K step as ``[MP, GPI, 16 (e), 4 (c)]`` in natural lane order (``m4 .. c4``, offsets ``xoff``; rows past M
    repeat row M - 1, masked to 0 by ``xmask``), and the block-diagonal B's mask ``diag`` ``[64 GPI, GPI MP]`` with
    each column's scale group ``gcol``."""
    NC: tl.constexpr = GPI * MP
    g3 = tl.arange(0, GPI)[None, :, None]
    e3 = tl.arange(0, 16)[None, None, :]
    m4 = tl.arange(0, MP)[:, None, None, None]
    g4 = tl.arange(0, GPI)[None, :, None, None]
    e4 = tl.arange(0, 16)[None, None, :, None]
    c4 = tl.arange(0, 4)[None, None, None, :]
    xoff = tl.minimum(m4, M - 1) * sx + g4 * 64 + e4 * 4 + c4
    xmask = (m4 < M) & (c4 >= 0) & (e4 >= 0) & (g4 >= 0)
    kk = tl.arange(0, 64 * GPI)[:, None]
    cc = tl.arange(0, NC)[None, :]
    diag = (kk // 64) == (cc // MP)
    gcol = cc // MP
    return g3, e3, m4, g4, e4, c4, xoff, xmask, diag, gcol


@triton.jit
def _k_step(acc, h, t, x_ptr, s_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, inv, r, xoff, roff, xmask, nstore, diag, gcol,
            M, K, ss, sh, sro, BN: tl.constexpr, GPI: tl.constexpr, MP: tl.constexpr, NORM: tl.constexpr,
            INTERP: tl.constexpr):
    """``acc`` plus K step ``t``: the weight tile ``h`` ([BN, GPI, 16] uint16) decoded and multiplied by x's lanes
    of the step (with NORM the normed lanes, stored by row block 0's programs)."""
    BB: tl.constexpr = 32 * GPI
    NC: tl.constexpr = GPI * MP
    m4 = tl.arange(0, MP)[:, None, None, None]
    g4 = tl.arange(0, GPI)[None, :, None, None]
    e4 = tl.arange(0, 16)[None, None, :, None]
    c4 = tl.arange(0, 4)[None, None, None, :]
    c0, c1, c2, c3 = _codes(h, INTERP)
    cw = tl.join(tl.join(c0, c1), tl.join(c2, c3))                           # [..., 2 (i1), 2 (i0)]: c_{2 i0 + i1}
    a = tl.reshape(tl.permute(cw, (0, 1, 4, 3, 2)), (BN, 2 * BB))            # k = g * 64 + c * 16 + e
    lane = 2 * t * BB + g4 * 64 + e4 * 4 + c4
    lmask = xmask & (lane < K)                                                # lanes past K (padding): 0
    xv = tl.load(x_ptr + xoff + 2 * t * BB, mask=lmask, other=0.0)            # [MP, GPI, 16, 4]
    if NORM:
        rv = tl.load(r_ptr + roff + 2 * t * BB, mask=lmask, other=0.0)
        res = cast(xv.to(tl.float32) + rv.to(tl.float32), ro_ptr.dtype.element_ty, INTERP)
        nw = tl.load(nw_ptr + lane, mask=lane < K, other=0.0).to(tl.float32)
        xv = cast((res.to(tl.float32) * inv) * (1.0 + nw), h_ptr.dtype.element_ty, INTERP)
        rows_lane = tl.minimum(m4, M - 1)
        tl.store(ro_ptr + rows_lane * sro + lane, res, mask=nstore & (lane < K))
        tl.store(h_ptr + rows_lane * sh + lane, xv, mask=nstore & (lane < K))
    xt = tl.trans(tl.reshape(tl.permute(xv, (0, 1, 3, 2)), (MP, 2 * BB)))     # [2 BB, MP], the decode's order
    xw = tl.reshape(tl.broadcast_to(xt[:, None, :], (2 * BB, GPI, MP)), (2 * BB, NC))
    xb = tl.where(diag, xw, 0.0)
    if INTERP:
        d = tl.dot(a.to(tl.float32), xb.to(tl.float32), input_precision="ieee")
    else:
        d = tl.dot(a, xb)
    sc = tl.load(s_ptr + r[:, None] * ss + t * GPI + gcol).to(tl.float32)
    return acc + d * sc


@triton.jit(do_not_specialize=["M", "TPS", "S"])
def _q4_tc_kernel(x_ptr, b_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, eps, M, N, OUT, K, BYTES,
                  TPS, S, sx, sb, ss, sy, sp, sr, sh, sro,
                  BN: tl.constexpr, GPI: tl.constexpr, MP: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr,
                  SWIGLU: tl.constexpr, NORM: tl.constexpr, PREFETCH: tl.constexpr, L2PF: tl.constexpr,
                  INTERP: tl.constexpr, PDL: tl.constexpr):
    BB: tl.constexpr = 32 * GPI          # bytes of a row per K step
    HB: tl.constexpr = 16 * GPI          # uint16 elements of a row per K step
    NC: tl.constexpr = GPI * MP
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)               # in-bounds rows: only the store is masked
    g3, e3, m4, g4, e4, c4, xoff, xmask, diag, gcol = lanes(M, sx, GPI, MP)
    acc = tl.zeros((BN, NC), dtype=tl.float32)
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, BYTES // BB)
    sbh = sb // 2
    # The run's bytes of every row asked of L2 while the previous kernel finishes (weights are never written).
    l2_prefetch(b_ptr + r * sbh + t0 * HB, tl.zeros((BN,), dtype=tl.int32) + (t1 - t0) * BB, L2PF, INTERP)
    if PREFETCH:   # the run's first weight tile streams before the wait (weights are never written)
        h_first = tl.load(b_ptr + r[:, None, None] * sbh + t0 * HB + g3 * 16 + e3)
    pdl_wait(PDL)
    inv = tl.zeros((MP, 1, 1, 1), dtype=tl.float32)
    roff = xoff
    nstore = xmask
    if NORM:   # x is the residual stream's new part: every program forms the normed lanes it needs
        inv = inv_rms(x_ptr, r_ptr, ro_ptr.dtype.element_ty, M, K, eps, sx, sr, MP, 512, INTERP)[:, None, None, None]
        roff = tl.minimum(m4, M - 1) * sr + g4 * 64 + e4 * 4 + c4
        # Row-block 0's programs store the normed rows and the new residual over their K range (each lane once).
        nstore = xmask & ((m4 * 0 + pid) == 0)   # a tensor, not a scalar mask (the interpreter wants one)
    start = t0
    if PREFETCH:
        acc = _k_step(acc, h_first, t0, x_ptr, s_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, inv, r, xoff, roff, xmask, nstore,
                      diag, gcol, M, K, ss, sh, sro, BN, GPI, MP, NORM, INTERP)
        start = t0 + 1
    for t in range(start, t1):
        h = tl.load(b_ptr + r[:, None, None] * sbh + t * HB + g3 * 16 + e3)       # [BN, GPI, 16] uint16
        acc = _k_step(acc, h, t, x_ptr, s_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, inv, r, xoff, roff,
                      xmask, nstore, diag, gcol, M, K, ss, sh, sro, BN, GPI, MP, NORM, INTERP)
    out = tl.sum(tl.reshape(acc, (BN, GPI, MP)), 1)                               # [BN, MP]
    store_out(out, y_ptr, p_ptr, cnt_ptr, x_ptr, n, nm, pid, sid, S, sp, sy, M, N, OUT, BN, MP, SPLIT, REDUCE, SWIGLU,
              INTERP)


def launch_shape(rows: int, w: KernelWeight) -> tuple[int, int, int] | None:
    """(MP, BN, GPI) for ``rows`` rows of x with ``w``, or None when this kernel cannot take the call (not q4, too
    many rows, or a row's bytes not whole K steps)."""
    if w.format != "q4_g64_fp16" or not 1 <= rows <= MAX_ROWS:
        return None
    if w.base.storage_offset() % 2 or w.base_stride % 2:   # the base plane is read as uint16
        return None
    mp = next_pow2(rows)
    bn, gpi = _SHAPES[mp]
    if (w.lanes // 2) % (32 * gpi):
        return None
    return mp, bn, gpi


def gemv_tc(x2: torch.Tensor, w: KernelWeight, *, norm: tuple | None = None, swiglu: bool = False,
            out_dtype: torch.dtype | None = None, split: int | None = None, prefetch: bool | None = None,
            in_kernel_sum: bool = True, l2_prefetch: bool | None = None) -> torch.Tensor:
    """``x2[M, K] @ decode(w).T`` for a q4 weight and bf16 ``x2`` (row-contiguous, ``M <= MAX_ROWS``), rounded to
    x2's dtype, stored as ``out_dtype`` (default x2's). ``norm = (residual2, norm_weight, eps, normed_out,
    residual_out)``: x2 is first replaced by its ``add_rms_norm_unit_offset`` with residual2 (formed in every
    program), stored to the given ``[M, K]`` outputs. ``swiglu``: w is ``[2I, K]`` (gate rows, then up rows), the
    result ``silu_and_mul`` of the product, ``[M, I]``, applied where the partials are added. ``split``: K runs
    (default: :func:`split_count` by :data:`SPLIT_RULE`). ``prefetch``: each program loads its first weight tile before
    the PDL wait and the norm prologue, the same sums in the same order (a candidate until timed; None:
    :data:`PREFETCH`). ``in_kernel_sum``: split-K partials added by the last program of each output block (else by
    the second kernel; the same bits either way). ``l2_prefetch``: each program asks L2 for its whole weight run
    before the PDL wait (None: :data:`L2_PREFETCH`; the same bits). A ``ValueError`` when :func:`launch_shape`
    refuses the call."""
    m, k = x2.shape
    shape = launch_shape(m, w)
    if shape is None or x2.dtype != torch.bfloat16:
        raise ValueError(f"q4 tensor-core gemv: cannot take {m} rows of {x2.dtype} with a {w.format} weight of "
                         f"{w.lanes} lanes a row")
    mp, bn, gpi = shape
    return launch(_q4_tc_kernel, x2, w, nbytes=w.lanes // 2, step=32 * gpi, bn=bn, norm=norm, swiglu=swiglu,
                  out_dtype=out_dtype, split=split, in_kernel_sum=in_kernel_sum, l2_prefetch=l2_prefetch, GPI=gpi,
                  MP=mp, PREFETCH=PREFETCH if prefetch is None else prefetch)


def launch(kernel, x2: torch.Tensor, w: KernelWeight, *, nbytes: int, step: int, bn: int, norm: tuple | None,
           swiglu: bool, out_dtype: torch.dtype | None, split: int | None, in_kernel_sum: bool = True,
           l2_prefetch: bool | None = None, **constexprs) -> torch.Tensor:
    """Run a tensor-core GEMV ``kernel`` of this module's signature (also :mod:`~ninfer.ops.triton.quant_gemv_tc8`'s):
    ``bn`` weight rows a program, ``nbytes`` of a row read ``step`` bytes a K step, split-K to fill the device,
    then the partials' sum (and SwiGLU): in the kernel where ``in_kernel_sum`` and the ticket counters allow, else
    in the second kernel. ``l2_prefetch`` (None: :data:`L2_PREFETCH`) takes effect where the bulk prefetch's
    alignment holds (a 16-byte aligned base plane and row stride)."""
    m, k = x2.shape
    if swiglu and w.n % 2:
        raise ValueError(f"add_rms_norm_unit_offset_swiglu: gate_up has {w.n} rows, not [2I, N]")
    n_out = w.n // 2 if swiglu else w.n
    y = torch.empty((m, n_out), dtype=out_dtype or x2.dtype, device=x2.device)
    if w.n == 0:
        return y
    steps = nbytes // step
    programs = triton.cdiv(w.n, bn)
    sp = plan(x2, y, w.n, steps, programs, bn, split_count(programs, steps) if split is None else split,
              swiglu=swiglu, in_kernel_sum=in_kernel_sum)
    r2, nw, eps, hn, ro = norm or (x2, x2, 0.0, x2, x2)
    l2 = (L2_PREFETCH if l2_prefetch is None else l2_prefetch) and l2_prefetch_aligned(w.base.data_ptr(),
                                                                                       w.base_stride)
    kw = {} if INTERPRET else dict(LAUNCH_OPTIONS)
    kernel[(programs, sp.runs)](
        x2, w.base.view(torch.uint16), w.scales, y, sp.part, sp.part if sp.counters is None else sp.counters, r2, nw,
        hn, ro, float(eps), m, w.n, n_out, k, nbytes, sp.steps_per_run, sp.runs, x2.stride(0), w.base_stride,
        w.scale_stride, y.stride(0), sp.part.stride(0) if sp.partials else 0, r2.stride(0), hn.stride(0),
        ro.stride(0), BN=bn, SPLIT=sp.partials, REDUCE=sp.counters is not None, SWIGLU=swiglu, NORM=norm is not None,
        L2PF=l2, INTERP=INTERPRET, **constexprs, **pdl(x2), **kw)
    if sp.partials and sp.counters is None:
        sum_partials(sp.part, y, x2, swiglu)
    return y

