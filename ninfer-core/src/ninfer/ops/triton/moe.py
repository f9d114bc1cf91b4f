"""Triton fused MoE experts (``moe_experts``): grouped GEMMs over token-expert pairs sorted by expert.

Contract (see :mod:`ninfer.ops.reference.moe`): out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),
e = ids[t, j], gate_up[e] = [gate rows (I); up rows (I)].

Pipeline (no host synchronisation: every size below depends only on T, k, E and the block size):
1. ``_align_fused`` (two launches; ``_align`` is its torch form, ~35 small kernels): group the T*k pairs by
   expert, pad each expert's group to a multiple of BM rows, and build ``pairs[max_blocks * BM]`` (the pair
   index t*k+j at each padded row, T*k marking padding) and ``block_expert[max_blocks]`` (E marking blocks past
   the used ones). max_blocks = ceil(T*k / BM) + min(E, T*k) bounds the padded count whatever the routing.
2. ``_moe_gate_up_kernel``, grid (blocks, I / BN): gathers the block's token rows of x, multiplies them by the
   expert's gate and up rows (two fp32 accumulators over one pass of x), applies silu(gate) * up in fp32 and
   rounds it to the activation dtype (as the model's module does before the down projection).
3. ``_moe_down_kernel``, grid (blocks, H / BN): act @ down_e^T in fp32, rounded to the activation dtype (the
   reference's rounding of an expert's output) and written to row t*k+j of a [T*k, H] buffer (a scatter by pair
   index).
4. ``_moe_sum_kernel``: out[t] = sum_j weight[t, j] * y[t*k+j] in fp32, in j order, rounded once to x.dtype.
Steps 3-4 replace an atomic fp32 scatter-add: the sum order is fixed, so the result is deterministic run to
run and independent of how other tokens were routed, for one extra T*k*H-element round trip in x's dtype.

Decode sizes (T * k <= ``moe_gemv.MAX_PAIRS``) skip the alignment and take the two GEMV kernels of
:mod:`ninfer.ops.triton.moe_gemv` instead (the shared expert fused into the down GEMV). On this grouped path a
shared expert (:class:`~ninfer.ops.contracts.SharedExpert`) is computed by the reference's torch ops and added in
fp32 by ``_moe_sum_kernel`` before the single rounding.

Limits: x, gate_up and down must share one dtype (bf16, fp16 or fp32) -- otherwise this falls back to the
torch reference, which promotes. fp32 uses IEEE dots (the suite's fp32 criterion is 2e-6). Routing ids are
trusted to lie in [0, E) (the router produces them); out-of-range ids are not checked on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.errors import NotSupportedError
from ninfer.ops.contracts import SharedExpert
from ninfer.ops.reference import moe as _reference
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton import moe_gemv
from ninfer.ops.triton._common import cast
from ninfer.switches import env_switch


@triton.jit(do_not_specialize=["TK"])
def _moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, pair_ptr, bexp_ptr,
                        H, NI, TK, E, sx_t, sw_e, sw_n,
                        TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(bexp_ptr + pm)
    if e < E:  # blocks past the used ones have no expert: nothing to do
        rows = pm * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + rows)
        valid = pair < TK
        # Padding rows read token 0 (in bounds, no load mask); their results are never used.
        tok = tl.where(valid, pair // TOPK, 0)
        n = pn * BN + tl.arange(0, BN)
        n_in = n % NI  # wrapped columns keep the weight loads in bounds unmasked; only the store is masked
        kk = tl.arange(0, BK)
        # Pointer tiles built once and advanced by BK: recomputing them per step costs 64-bit registers
        # per element, enough to spill.
        a_ptrs = x_ptr + tok[:, None] * sx_t + kk[None, :]
        # Weight tiles are loaded as [BN, BK] (rows of the [2I, H] matrix, K contiguous: 16-byte loads) and
        # transposed for the dot; a [BK, BN] pointer tile compiled to 2-byte loads.
        g_ptrs = w_ptr + e * sw_e + n_in[:, None] * sw_n + kk[None, :]     # gate rows, [BN, BK]
        u_ptrs = g_ptrs + NI * sw_n                                          # up rows
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            if EVEN_K:
                a = tl.load(a_ptrs)
                wg = tl.load(g_ptrs)
                wu = tl.load(u_ptrs)
            else:
                km = (k0 + kk) < H
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=km[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=km[None, :], other=0.0)
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            wg, wu = tl.trans(wg), tl.trans(wu)
            if IEEE:
                acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
            a_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + rows[:, None] * NI + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=(n < NI)[None, :])


@triton.jit(do_not_specialize=["TK"])
def _moe_down_kernel(act_ptr, w_ptr, y_ptr, pair_ptr, bexp_ptr,
                     H, NI, TK, E, sw_e, sw_n,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                     IEEE: tl.constexpr, UPCAST: tl.constexpr, INTERP: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(bexp_ptr + pm)
    if e < E:
        rows = pm * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + rows)
        valid = pair < TK
        n = pn * BN + tl.arange(0, BN)
        n_in = n % H
        kk = tl.arange(0, BK)
        # act rows of a used block were all written by the gate_up kernel (padding rows too), so the act
        # loads need no row mask.
        a_ptrs = act_ptr + rows[:, None] * NI + kk[None, :]
        w_ptrs = w_ptr + e * sw_e + n_in[:, None] * sw_n + kk[None, :]    # [BN, BK], K contiguous
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, NI, BK):
            if EVEN_K:
                a = tl.load(a_ptrs)
                wd = tl.load(w_ptrs)
            else:
                km = (k0 + kk) < NI
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                wd = tl.load(w_ptrs, mask=km[None, :], other=0.0)
            if UPCAST:
                a, wd = a.to(tl.float32), wd.to(tl.float32)
            wd = tl.trans(wd)
            if IEEE:
                acc = tl.dot(a, wd, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, wd, acc)
            a_ptrs += BK
            w_ptrs += BK
        tl.store(y_ptr + pair[:, None] * H + n[None, :], cast(acc, y_ptr.dtype.element_ty, INTERP),
                 mask=valid[:, None] & (n < H)[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, rw_ptr, extra_ptr, out_ptr, H, so_t, TOPK: tl.constexpr, BH: tl.constexpr,
                    HAS_EXTRA: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BH + tl.arange(0, BH)
    nm = n < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        w = tl.load(rw_ptr + t * TOPK + j)
        acc += tl.load(y_ptr + (t * TOPK + j) * H + n, mask=nm, other=0.0).to(tl.float32) * w
    if HAS_EXTRA:  # the shared expert's fp32 term [T, H]
        acc += tl.load(extra_ptr + t * H + n, mask=nm, other=0.0)
    tl.store(out_ptr + t * so_t + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


@dataclass(frozen=True)
class PrefillTiles:
    """The grouped path's launch shape: row blocks of up to ``block_m_max`` pairs (fewer when experts get fewer
    pairs on average), ``block_n`` output columns of the gate/up and down kernels, ``block_k`` inputs per dot step
    (32 in fp32), and the kernels' warps and pipeline stages. Any value gives the same result up to the dots'
    accumulation order (``block_k``); tools/gpu_moe_prefill_sweep.py times the alternatives."""

    block_m_max: int = 64
    block_n: tuple[int, int] = (64, 128)
    block_k: int = 64
    warps: int = 4
    stages: int = 3


# Prefill chunks of at least LARGE_PAIRS token-expert pairs take LARGE_TILES (16-bit dtypes): wider row blocks and
# column tiles, 8 warps (tools/gpu_moe_prefill_sweep.py: the fastest candidate at 2,048 and 8,192 tokens of the
# 35B-A3B expert shape).
LARGE_PAIRS = 16384
LARGE_TILES = PrefillTiles(128, (128, 256), 64, 8, 3)
# NINFER_MOE_GROUPED_MM=1 (read once): bf16 calls of at least LARGE_PAIRS pairs run their two expert GEMMs through
# torch._grouped_mm instead of the Triton kernels (a candidate; tools/gpu_moe_prefill_sweep.py times both).
GROUPED_MM = env_switch("NINFER_MOE_GROUPED_MM", False)


def _block_m(tk: int, n_exp: int, cap: int = 64) -> int:
    # Rows per block ~ the mean pairs per expert, in [16, cap]: decode (a few pairs per expert) wastes at most
    # 15 padded rows per expert; prefill (T=2048, k=8, E=256: 64 per expert) fills 64-row tiles.
    mean = -(-tk // n_exp)
    return min(cap, max(16, triton.next_power_of_2(mean)))


@triton.jit(do_not_specialize=["TK", "MAXB"])
def _align_plan_kernel(ids_ptr, pairs_ptr, bexp_ptr, start_ptr, cursor_ptr, TK, E, MAXB, BM: tl.constexpr,
                       BE: tl.constexpr, BLOCK: tl.constexpr, BB: tl.constexpr):
    # One program: the experts' pair counts, each expert's first padded row, the expert of every row block (E past
    # the used ones), the padding fill of every row, and the zeroed per-expert cursors of _align_scatter_kernel.
    e_idx = tl.arange(0, BE)
    counts = tl.zeros((BE,), dtype=tl.int32)
    for p0 in range(0, TK, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < TK
        e = tl.where(m, tl.load(ids_ptr + p, mask=m, other=0), 0).to(tl.int32)
        # Masked lanes count as expert 0 and are taken back (a histogram without a mask argument).
        counts += tl.histogram(e, BE) - tl.where(e_idx == 0, BLOCK - tl.sum(m.to(tl.int32), 0), 0)
    nblk = (counts + BM - 1) // BM
    blk_end = tl.cumsum(nblk, 0)          # lanes past E hold the total: no block ends there before it
    tl.store(start_ptr + e_idx, ((blk_end - nblk) * BM).to(tl.int64), mask=e_idx < E)
    tl.store(cursor_ptr + e_idx, tl.zeros((BE,), dtype=tl.int32), mask=e_idx < E)
    for b0 in range(0, MAXB, BB):
        b = b0 + tl.arange(0, BB)
        ex = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(bexp_ptr + b, tl.minimum(ex, E).to(tl.int64), mask=b < MAXB)
    for r0 in range(0, MAXB * BM, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        tl.store(pairs_ptr + r, tl.zeros((BLOCK,), dtype=tl.int64) + TK, mask=r < MAXB * BM)


@triton.jit(do_not_specialize=["TK"])
def _align_scatter_kernel(ids_ptr, pairs_ptr, start_ptr, cursor_ptr, TK, BLOCK: tl.constexpr):
    # Each pair takes the next row of its expert's group. The order inside a group depends on the atomics' order,
    # which changes no result: a GEMM row depends on its own row only, and the down kernel writes by pair index.
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = p < TK
    e = tl.load(ids_ptr + p, mask=m, other=0)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=m, sem="relaxed")
    pos = tl.load(start_ptr + e, mask=m, other=0) + row
    tl.store(pairs_ptr + pos, p.to(tl.int64), mask=m)


def _align_fused(ids: torch.Tensor, n_exp: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`_align`'s layout in two launches (instead of ~35 small torch kernels, each a host launch in a
    prefill chunk): the same block experts and per-expert row groups; rows inside a group in any order."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    tk = flat.numel()
    dev = flat.device
    max_blocks = -(-tk // bm) + min(n_exp, tk)
    pairs = torch.empty((max_blocks * bm,), dtype=torch.int64, device=dev)
    block_expert = torch.empty((max_blocks,), dtype=torch.int64, device=dev)
    start = torch.empty((n_exp,), dtype=torch.int64, device=dev)
    cursor = torch.empty((n_exp,), dtype=torch.int32, device=dev)
    kw = {} if dev.type != "cuda" else {"num_warps": 8}
    _align_plan_kernel[(1,)](flat, pairs, block_expert, start, cursor, tk, n_exp, max_blocks, BM=bm,
                             BE=triton.next_power_of_2(n_exp), BLOCK=1024, BB=64, **kw)
    _align_scatter_kernel[(triton.cdiv(tk, 1024),)](flat, pairs, start, cursor, tk, BLOCK=1024, **kw)
    return pairs, block_expert, max_blocks


def _align(ids: torch.Tensor, n_exp: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(pairs[max_blocks*bm] int64, block_expert[max_blocks] int64, max_blocks); device ops only, no sync.
    The torch form of :func:`_align_fused` (pairs stable-sorted inside each group): the tests' reference."""
    flat = ids.reshape(-1)
    tk = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)                       # pair indices grouped by expert
    counts = torch.zeros(n_exp, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    nblk = (counts + bm - 1) // bm
    blk_end = torch.cumsum(nblk, 0)
    blk_start = blk_end - nblk
    pair_start = torch.cumsum(counts, 0) - counts
    max_blocks = -(-tk // bm) + min(n_exp, tk)
    # searchsorted on the inclusive block ends: block b belongs to the first expert whose end exceeds b; blocks
    # past the last used one get E.
    block_expert = torch.searchsorted(blk_end, torch.arange(max_blocks, device=dev), right=True)
    sorted_e = flat[order]
    pos = blk_start[sorted_e] * bm + (torch.arange(tk, device=dev) - pair_start[sorted_e])
    pairs = torch.full((max_blocks * bm,), tk, dtype=torch.int64, device=dev)
    pairs.scatter_(0, pos, order)
    return pairs, block_expert, max_blocks


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, *, shared: SharedExpert | None = None,
                block_n: tuple[int, int] | None = None, gemv: bool | None = None,
                tiles: PrefillTiles | None = None, grouped_mm: bool | None = None) -> torch.Tensor:
    """Weighted sum of the routed experts' SwiGLU MLPs for ``x[T, H]`` (plus the shared expert when given);
    returns [T, H] in x.dtype. ``gemv`` forces (True) or forbids (False) the decode path (None: by size);
    ``tiles`` overrides the grouped path's launch shape (``block_n`` its column tiles alone); ``grouped_mm`` forces
    (True) or forbids (False) the torch._grouped_mm GEMMs (None: :data:`GROUPED_MM` for large bf16 calls)."""
    same = x.dtype == gate_up.dtype == down.dtype and x.dtype in _DTYPES
    if shared is not None:
        same = same and shared.projected.dtype == x.dtype == shared.down.dtype
        if shared.projected.stride(-1) != 1 or shared.down.stride(-1) != 1:
            shared = SharedExpert(shared.projected.contiguous(), shared.down.contiguous(), shared.gate_logit)
    if not same:
        return _reference.moe_experts(x, weights, ids, gate_up, down, shared=shared)
    t_len, hidden = x.shape
    top_k = ids.shape[1]
    n_exp, two_i, _ = gate_up.shape
    inter = two_i // 2
    out = torch.empty((t_len, hidden), dtype=x.dtype, device=x.device)
    if t_len == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(2) == 1 else gate_up.contiguous()
    down = down if down.stride(2) == 1 else down.contiguous()
    if gemv if gemv is not None else t_len * top_k <= moe_gemv.MAX_PAIRS:
        return moe_gemv.moe_experts_gemv(x, weights, ids, gate_up, down, shared)
    rw = weights.reshape(-1).float().contiguous()
    tk = t_len * top_k
    if grouped_mm is None:
        grouped_mm = GROUPED_MM and tk >= LARGE_PAIRS and x.dtype == torch.bfloat16
    if grouped_mm:
        return _grouped_mm_experts(x, rw, ids, gate_up, down, shared, out)
    if tiles is None and block_n is None and tk >= LARGE_PAIRS and x.dtype != torch.float32:
        tiles = LARGE_TILES
    bm = _block_m(tk, n_exp, tiles.block_m_max if tiles else 64)
    pairs, block_expert, max_blocks = _align_fused(ids, n_exp, bm)
    ieee = x.dtype == torch.float32
    interp = x.device.type != "cuda"
    # The Triton interpreter (3.9, numpy 2.4) multiplies bf16/fp16 dot operands as raw bits: there, and only
    # there, operands are widened to fp32 first (exact for 16-bit inputs; the compiled path keeps 16-bit
    # tensor-core dots with fp32 accumulation, the same products).
    upcast = interp and x.dtype != torch.float32
    # Decode grids are small (T=1, k=8: 8 blocks): narrower N tiles put more programs on the SMs to stream the
    # expert weights; prefill keeps wider tiles for reuse.
    if tiles is not None:
        bn1, bn2 = tiles.block_n
    elif block_n is not None:
        bn1, bn2 = block_n
    elif max_blocks <= 32:
        bn1, bn2 = 32, 64
    else:
        bn1, bn2 = 64, 128
    bk = 32 if ieee else tiles.block_k if tiles else 64
    kw = {} if interp else {"num_warps": tiles.warps if tiles else 4, "num_stages": tiles.stages if tiles else 3}
    act = torch.empty((max_blocks * bm, inter), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(max_blocks, triton.cdiv(inter, bn1))](
        x, gate_up, act, pairs, block_expert, hidden, inter, tk, n_exp,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOPK=top_k, BM=bm, BN=bn1, BK=bk, EVEN_K=hidden % bk == 0, IEEE=ieee, UPCAST=upcast, **kw)
    y = torch.empty((tk, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(max_blocks, triton.cdiv(hidden, bn2))](
        act, down, y, pairs, block_expert, hidden, inter, tk, n_exp,
        down.stride(0), down.stride(1),
        BM=bm, BN=bn2, BK=bk, EVEN_K=inter % bk == 0, IEEE=ieee,
        UPCAST=upcast, INTERP=interp, **kw)
    extra = None if shared is None else _reference.shared_expert_fp32(shared, x.dtype).contiguous()
    bh = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(t_len, triton.cdiv(hidden, bh))](y, rw, y if extra is None else extra, out, hidden,
                                                      out.stride(0), TOPK=top_k, BH=bh, HAS_EXTRA=extra is not None)
    return out


def _grouped_mm_experts(x: torch.Tensor, rw: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, shared: SharedExpert | None, out: torch.Tensor) -> torch.Tensor:
    """The routed sum with both expert GEMMs as torch._grouped_mm over the pairs sorted by expert (no padding: the
    groups end at the experts' cumulative pair counts, all on the device). The roundings are the reference's: each
    GEMM's output in x's dtype, the SwiGLU in fp32 rounded to x's dtype, the routing weight applied in fp32. Each
    pair's row is written at its pair index and ``_moe_sum_kernel`` weights and sums them in j order, as the Triton
    path does: deterministic, and the same sum of the same rounded rows."""
    if not hasattr(torch, "_grouped_mm"):
        raise NotSupportedError("moe_experts(grouped_mm=True) needs torch._grouped_mm, which this torch lacks")
    t_len, top_k = ids.shape
    n_exp, two_i, hidden = gate_up.shape
    inter = two_i // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_exp, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x.index_select(0, order // top_k), gate_up.transpose(1, 2), offs=offs)
    act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    pairs = torch.empty((t_len * top_k, hidden), dtype=x.dtype, device=x.device)
    pairs.index_copy_(0, order, y)
    extra = None if shared is None else _reference.shared_expert_fp32(shared, x.dtype).contiguous()
    bh = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(t_len, triton.cdiv(hidden, bh))](pairs, rw, pairs if extra is None else extra, out, hidden,
                                                      out.stride(0), TOPK=top_k, BH=bh, HAS_EXTRA=extra is not None)
    return out


_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

OPS = [
    OpImpl(op="moe_experts", name="triton", fn=moe_experts, devices=frozenset({"cuda"}), dtypes=_DTYPES,
           priority=10),
]
