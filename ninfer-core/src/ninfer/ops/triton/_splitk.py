"""Split-K for the decode GEMVs: the fp32 partials of K runs and their sum, in the kernel or after it.

A GEMV over a weight of few rows splits K over ``S`` programs per row block so that the device fills; program
(row block ``pid``, K run ``sid``) stores its fp32 partial ``[S, M, N]``. The program that arrives last at its
output block adds the block's partials in split order and rounds once to the output dtype (:func:`store_out` with
REDUCE): deterministic (the order is fixed, whichever program arrives last), and no second launch, whose latency
is a large share of a narrow projection's time at one row of x. Arrival is counted by a ticket counter per output
block (:func:`tickets`), taken with release/acquire ordering after a CTA barrier, so the last program sees every
other program's partial; it reads them from L2 and resets the counter to zero for the next launch.

Where no counters apply (a SwiGLU weight whose half is not whole row blocks, more blocks than counters),
:func:`sum_partials` adds the partials in a second kernel, in the same order with the same rounding: the two paths
give the same bits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer.ops.triton._common import INTERPRET, cast


@triton.jit
def store_out(out, y_ptr, p_ptr, cnt_ptr, x_ptr, n, nm, pid, sid, S, sp, sy, M, N, OUT, BN: tl.constexpr,
              MP: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr, SWIGLU: tl.constexpr,
              INTERP: tl.constexpr):
    """``out[BN, MP]``, program (``pid``, K run ``sid``): one run (not SPLIT) rounds to x's dtype and stores it. SPLIT
    stores the fp32 partial; with REDUCE the program that arrives last at its output block then adds the block's
    partials in split order and rounds once (SWIGLU: ``silu(gate) * up``; the block is then gate rows ``pid`` and up
    rows ``pid + OUT // BN``, ``2 S`` arrivals: ``OUT % BN == 0``) and resets the block's ticket counter for the next
    launch. Without REDUCE :func:`sum_partials` adds them after the launch."""
    mm = tl.arange(0, MP)[None, :]
    keep = nm[:, None] & (mm < M)
    if SPLIT:
        tl.store(p_ptr + sid * sp + mm * N + n[:, None], out, mask=keep)
        if REDUCE:
            if SWIGLU:
                blk = pid % (OUT // BN)
                arrivals = 2 * S
            else:
                blk = pid
                arrivals = S
            tl.debug_barrier()   # every thread's partial is written before the (release) ticket is taken
            ticket = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if ticket == arrivals - 1:
                j = blk * BN + tl.arange(0, BN)[:, None]
                jm = (j < OUT) & (mm < M)
                y = _summed(p_ptr, mm * N + j, jm, S, sp, OUT, x_ptr, y_ptr, SWIGLU, INTERP)
                tl.store(y_ptr + mm * sy + j, y, mask=jm)
                tl.atomic_xchg(cnt_ptr + blk, 0, sem="relaxed", scope="gpu")
    else:
        y = cast(out, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + mm * sy + n[:, None], y, mask=keep)


@triton.jit
def _summed(p_ptr, off, msk, S, sp, OUT, x_ptr, y_ptr, SWIGLU: tl.constexpr, INTERP: tl.constexpr):
    """The partials at ``off`` of every split added in split order and rounded once to x's dtype, as y's dtype;
    with SWIGLU ``silu(g) * u`` of the rounded gate sum g (at ``off``) and up sum u (at ``off + OUT``). One code for
    both paths, so the in-kernel sum and :func:`sum_partials` give the same bits. Loads from L2 (``.cg``): in the
    kernel the partials are other programs' stores, never in this SM's L1."""
    acc = tl.zeros_like(off).to(tl.float32)
    acc_u = tl.zeros_like(off).to(tl.float32)
    for s in range(0, S):
        acc += tl.load(p_ptr + s * sp + off, mask=msk, other=0.0, cache_modifier=".cg")
        if SWIGLU:
            acc_u += tl.load(p_ptr + s * sp + OUT + off, mask=msk, other=0.0, cache_modifier=".cg")
    if SWIGLU:
        g = cast(acc, x_ptr.dtype.element_ty, INTERP).to(tl.float32)
        u = cast(acc_u, x_ptr.dtype.element_ty, INTERP).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * u
    return cast(acc, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)


@triton.jit
def _sum_kernel(p_ptr, y_ptr, x_ptr, S, N, OUT, sp, SWIGLU: tl.constexpr, BLOCK: tl.constexpr,
                INTERP: tl.constexpr):
    """Program (row m, block of outputs): :func:`_summed` of the row's partials ``p[s, m, :]``."""
    m = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = j < OUT
    tl.store(y_ptr + m * OUT + j, _summed(p_ptr, m * N + j, msk, S, sp, OUT, x_ptr, y_ptr, SWIGLU, INTERP), mask=msk)


def sum_partials(part: torch.Tensor, y: torch.Tensor, x2: torch.Tensor, swiglu: bool) -> None:
    """``y[M, OUT]`` = the partials ``part[S, M, N]`` added in split order and rounded once to x2's dtype (SwiGLU:
    ``silu(gate) * up`` of the rounded halves, ``N = 2 OUT``)."""
    s, m, n = part.shape
    n_out = y.shape[1]
    block = 1024
    _sum_kernel[(m, triton.cdiv(n_out, block))](part, y, x2, s, n, n_out, part.stride(0), SWIGLU=swiglu,
                                                BLOCK=block, INTERP=INTERPRET)


# Ticket counters of the in-kernel split-K sum, one per output block, per (device, launching thread). Zero between
# launches (the last program of a block resets its own). Launches that share a set never overlap on it: one thread
# (an Engine's worker) queues its kernels on one stream in order, and a PDL launch touches the counters only after
# pdl_wait, when the previous launch has completed. Two threads (two Engines on one device) get two sets, since
# their streams may run at once.
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MAX_BLOCKS = 1 << 14


def tickets(device: torch.device, blocks: int) -> torch.Tensor | None:
    """The counters of this thread's launches on ``device``, or None when a weight has more output blocks than
    there are counters (then :func:`sum_partials` runs)."""
    if blocks > _MAX_BLOCKS:
        return None
    key = (device, threading.get_ident())
    t = _TICKETS.get(key)
    if t is None:
        t = _TICKETS[key] = torch.zeros(_MAX_BLOCKS, dtype=torch.int32, device=device)
    return t


@dataclass(frozen=True)
class SplitPlan:
    """How a split-K GEMV launch runs K: ``runs`` K runs of ``steps_per_run`` steps (every run non-empty); with
    ``partials`` (several runs, or SwiGLU) ``part`` holds the fp32 partials ``[runs, M, N]``, else it is the output
    itself, which the kernel stores straight to; ``counters``: the ticket counters when the last program of each
    block adds the partials, else None (then :func:`sum_partials` runs after the launch)."""

    runs: int
    steps_per_run: int
    partials: bool
    part: torch.Tensor
    counters: torch.Tensor | None


def plan(x2: torch.Tensor, y: torch.Tensor, n: int, steps: int, programs: int, block_n: int, runs: int, *,
         swiglu: bool, in_kernel_sum: bool) -> SplitPlan:
    """The launch's :class:`SplitPlan` for ``runs`` requested K runs over ``steps`` steps, ``programs`` row blocks of
    ``block_n`` rows of an ``n``-row weight (SwiGLU: gate rows then up rows; its halves must be whole blocks for one
    counter to see both, else the sum kernel adds them)."""
    tps = max(1, -(-steps // runs))
    runs = max(1, -(-steps // tps))                        # no empty runs
    partials = runs > 1 or swiglu
    part = torch.empty((runs, x2.shape[0], n), dtype=torch.float32, device=x2.device) if partials else y
    n_out = n // 2 if swiglu else n
    counters = (tickets(x2.device, programs) if in_kernel_sum and partials and not (swiglu and n_out % block_n)
                else None)
    return SplitPlan(runs, tps, partials, part, counters)
