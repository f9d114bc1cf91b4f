"""The q4 tensor-core decode GEMV with stream-K work division (``NINFER_QUANT_SPLIT=streamk``, a candidate).

Why: :mod:`~ninfer.ops.triton.quant_gemv_tc` gives every program one row block and one K run, so a projection's
programs come in whole row blocks. At one row of x the 9B in-projection (97 row blocks of 8 K steps) then runs as
291 programs of 2-3 steps, two waves on a device that holds 264 at once, or, splitting less, 194 programs of 4 steps
with 70 slots idle. Here the (row block, K step) units of the whole weight, in row-block-major order, are shared out
evenly: program ``p`` of ``P`` takes units ``[p U / P, (p + 1) U / P)``, so every slot streams the same number of
weight tiles (the in-projection: 264 programs of 2-3 steps, one wave). A program's share may span the end of one
row block and the start of the next; it runs each piece as a K run of that block.

Per piece the program stores an fp32 partial in the block's next slot (its rank among the block's contributors,
which follow from ``p``, ``P`` and ``U`` alone) and takes a ticket from the block's counter; the program that
arrives last adds the block's partials in slot order and rounds once (:mod:`~ninfer.ops.triton._splitk`'s protocol,
here with a contributor count per block: deterministic, no second launch). SwiGLU pairs gate block ``b`` with up
block ``b + OUT / BN`` on one counter: the last of both blocks' contributors forms ``silu(gate) * up`` of the
rounded sums.

The K step itself (decode, dot, scales, the norm prologue) is :func:`quant_gemv_tc._k_step`, so the products are
the same; only how K is split, and hence the fp32 partials' grouping, differs. Where this kernel cannot take a call
(a SwiGLU half that is not whole row blocks, more row blocks than ticket counters) :func:`gemv_tc` runs
:func:`quant_gemv_tc.gemv_tc` with the ``fill`` split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import quant_gemv_tc
from ninfer.ops.triton._common import INTERPRET, cast, l2_prefetch, l2_prefetch_aligned, pdl, pdl_wait
from ninfer.ops.triton._quant import KernelWeight
from ninfer.ops.triton._splitk import tickets
from ninfer.ops.triton.quant_gemv_tc import _k_step, inv_rms, lanes


@triton.jit
def _owner(u, P, UNITS):
    """The program whose share holds unit ``u``: the largest p with ``p * UNITS // P <= u``."""
    return ((u + 1) * P - 1) // UNITS


@triton.jit
def _block_sum(p_ptr, off, msk, count, sp):
    """The fp32 partials at ``off`` of the block's ``count`` contributors, added in slot order."""
    acc = tl.zeros_like(off).to(tl.float32)
    for s in range(0, count):
        acc += tl.load(p_ptr + s * sp + off, mask=msk, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit(do_not_specialize=["M", "STEPS", "UNITS", "P"])
def _q4_streamk_kernel(x_ptr, b_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, eps, M, N, OUT, K,
                       STEPS, UNITS, P, sx, sb, ss, sy, sp, sr, sh, sro,
                       BN: tl.constexpr, GPI: tl.constexpr, MP: tl.constexpr, SWIGLU: tl.constexpr,
                       NORM: tl.constexpr, L2PF: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    BB: tl.constexpr = 32 * GPI          # bytes of a row per K step
    HB: tl.constexpr = 16 * GPI          # uint16 elements of a row per K step
    NC: tl.constexpr = GPI * MP
    pid = tl.program_id(0)
    u0 = pid * UNITS // P
    u1 = (pid + 1) * UNITS // P
    g3, e3, m4, g4, e4, c4, xoff, xmask, diag, gcol = lanes(M, sx, GPI, MP)
    mm = tl.arange(0, MP)[None, :]
    sbh = sb // 2
    # The share's bytes of every row, piece by piece, asked of L2 while the previous kernel finishes.
    if L2PF:
        u = u0
        while u < u1:
            rb = u // STEPS
            ts = u - rb * STEPS
            te = tl.minimum(STEPS, ts + (u1 - u))
            rp = tl.minimum(rb * BN + tl.arange(0, BN), N - 1)
            l2_prefetch(b_ptr + rp * sbh + ts * HB, tl.zeros((BN,), dtype=tl.int32) + (te - ts) * BB, L2PF, INTERP)
            u = rb * STEPS + te
    pdl_wait(PDL)
    inv = tl.zeros((MP, 1, 1, 1), dtype=tl.float32)
    roff = xoff
    if NORM:   # every program forms the normed lanes it needs
        inv = inv_rms(x_ptr, r_ptr, ro_ptr.dtype.element_ty, M, K, eps, sx, sr, MP, 512, INTERP)[:, None, None, None]
        roff = tl.minimum(m4, M - 1) * sr + g4 * 64 + e4 * 4 + c4
    half = OUT // BN                     # SwiGLU: up block b + half pairs with gate block b
    u = u0
    while u < u1:
        rb = u // STEPS
        ts = u - rb * STEPS
        te = tl.minimum(STEPS, ts + (u1 - u))
        n = rb * BN + tl.arange(0, BN)
        nm = n < N
        r = tl.where(nm, n, 0)
        # Row block 0's pieces store the normed rows and the new residual (each lane once over its K steps).
        nstore = xmask & ((m4 * 0 + rb) == 0)
        acc = tl.zeros((BN, NC), dtype=tl.float32)
        for t in range(ts, te):
            h = tl.load(b_ptr + r[:, None, None] * sbh + t * HB + g3 * 16 + e3)       # [BN, GPI, 16] uint16
            acc = _k_step(acc, h, t, x_ptr, s_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, inv, r, xoff, roff,
                          xmask, nstore, diag, gcol, M, K, ss, sh, sro, BN, GPI, MP, NORM, INTERP)
        out = tl.sum(tl.reshape(acc, (BN, GPI, MP)), 1)                               # [BN, MP]
        first = _owner(rb * STEPS, P, UNITS)
        tl.store(p_ptr + (pid - first) * sp + mm * N + n[:, None], out, mask=nm[:, None] & (mm < M))
        if SWIGLU:
            gate_rb = rb % half
            up_rb = gate_rb + half
            g_first = _owner(gate_rb * STEPS, P, UNITS)
            g_count = _owner(gate_rb * STEPS + STEPS - 1, P, UNITS) - g_first + 1
            u_first = _owner(up_rb * STEPS, P, UNITS)
            u_count = _owner(up_rb * STEPS + STEPS - 1, P, UNITS) - u_first + 1
            blk = gate_rb
            arrivals = g_count + u_count
        else:
            blk = rb
            arrivals = _owner(rb * STEPS + STEPS - 1, P, UNITS) - first + 1
        tl.debug_barrier()   # every thread's partial is written before the (release) ticket is taken
        ticket = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
        if ticket == arrivals - 1:
            j = blk * BN + tl.arange(0, BN)[:, None]
            if SWIGLU:
                jm = (j < OUT) & (mm < M)
                g = cast(_block_sum(p_ptr, mm * N + j, jm, g_count, sp), x_ptr.dtype.element_ty,
                         INTERP).to(tl.float32)
                up = cast(_block_sum(p_ptr, mm * N + OUT + j, jm, u_count, sp), x_ptr.dtype.element_ty,
                          INTERP).to(tl.float32)
                y = g / (1.0 + tl.exp(-g)) * up
            else:
                jm = (j < N) & (mm < M)
                y = _block_sum(p_ptr, mm * N + j, jm, arrivals, sp)
            y = cast(y, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + mm * sy + j, y, mask=jm)
            tl.atomic_xchg(cnt_ptr + blk, 0, sem="relaxed", scope="gpu")
        u = rb * STEPS + te


def contributors(blocks: int, steps: int, programs: int) -> int:
    """The most programs whose shares meet one row block: ``blocks`` blocks of ``steps`` units over ``programs``
    programs of ``U // P`` or ``U // P + 1`` units each (a block of ``steps`` units meets at most
    ``1 + ceil((steps - 1) / (U // P))`` of them)."""
    least = blocks * steps // programs
    return 1 + -(-(steps - 1) // least)


def shares(blocks: int, steps: int, slots: int | None = None) -> int:
    """Programs of a stream-K launch: one a slot (``slots`` None: the device's target), never more than units."""
    return max(1, min(slots or quant_gemv_tc._TARGET_PROGRAMS, blocks * steps))


def gemv_tc(x2: torch.Tensor, w: KernelWeight, *, norm: tuple | None = None, swiglu: bool = False,
            out_dtype: torch.dtype | None = None, l2_prefetch: bool | None = None,
            slots: int | None = None) -> torch.Tensor:
    """:func:`quant_gemv_tc.gemv_tc`'s contract (q4 weights, bf16 x, up to 8 rows), K shared out stream-K over
    ``slots`` programs (None: the device's target). Falls back to :func:`quant_gemv_tc.gemv_tc` (``fill`` split)
    where the ticket counters cannot cover the call."""
    m, k = x2.shape
    shape = quant_gemv_tc.launch_shape(m, w)
    if shape is None or x2.dtype != torch.bfloat16:
        raise ValueError(f"q4 stream-K gemv: cannot take {m} rows of {x2.dtype} with a {w.format} weight of "
                         f"{w.lanes} lanes a row")
    mp, bn, gpi = shape
    if swiglu and w.n % 2:
        raise ValueError(f"add_rms_norm_unit_offset_swiglu: gate_up has {w.n} rows, not [2I, N]")
    n_out = w.n // 2 if swiglu else w.n
    blocks = triton.cdiv(w.n, bn)
    cnt = tickets(x2.device, blocks)
    if cnt is None or (swiglu and n_out % bn):
        return quant_gemv_tc.gemv_tc(x2, w, norm=norm, swiglu=swiglu, out_dtype=out_dtype, split=None,
                                     l2_prefetch=l2_prefetch)
    y = torch.empty((m, n_out), dtype=out_dtype or x2.dtype, device=x2.device)
    if w.n == 0:
        return y
    steps = (w.lanes // 2) // (32 * gpi)
    programs = shares(blocks, steps, slots)
    part = torch.empty((contributors(blocks, steps, programs), m, w.n), dtype=torch.float32, device=x2.device)
    if norm is None:
        r2 = nw = hn = ro = x2
        eps = 0.0
    else:
        r2, nw, eps, hn, ro = norm
    l2 = (quant_gemv_tc.L2_PREFETCH if l2_prefetch is None else l2_prefetch) and l2_prefetch_aligned(
        w.base.data_ptr(), w.base_stride)
    kw = {} if INTERPRET else dict(quant_gemv_tc.LAUNCH_OPTIONS)
    _q4_streamk_kernel[(programs,)](
        x2, w.base.view(torch.uint16), w.scales, y, part, cnt, r2, nw, hn, ro, float(eps), m, w.n, n_out, k, steps,
        blocks * steps, programs, x2.stride(0), w.base_stride, w.scale_stride, y.stride(0), part.stride(0),
        r2.stride(0), hn.stride(0), ro.stride(0), BN=bn, GPI=gpi, MP=mp, SWIGLU=swiglu, NORM=norm is not None,
        L2PF=l2, INTERP=INTERPRET, **pdl(x2), **kw)
    return y


def launch_shape(rows: int, w: KernelWeight):
    """The calls this module takes: :func:`quant_gemv_tc.launch_shape`'s."""
    return quant_gemv_tc.launch_shape(rows, w)
