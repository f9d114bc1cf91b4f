"""Triton ``moe_experts`` for quantized expert banks (every format of :mod:`ninfer.quant`), selected by the
stored format (``OpImpl.weight_formats``): the op's dispatcher routes a call holding a
:class:`~ninfer.quant.PackedWeight` here.

Contract: the quantized reference (:func:`ninfer.ops.reference.quantized.moe_experts`): the dense op with each
expert decoded to fp32 (``scale * code``), so the expert GEMMs and the SwiGLU activation run in fp32; the shared
expert's activation is rounded to x.dtype; one fp32 sum, rounded once to x.dtype. Either bank and the shared
expert's down projection may each be packed in any format or dense (of x's dtype).

Paths (chosen by size, as the bf16 op chooses: up to ``moe_gemv.MAX_PAIRS`` (token, expert) pairs):
- decode: the GEMVs of :mod:`ninfer.ops.triton.quant_moe_gemv` (packed codes read once, fp32 throughout).
- prefill: grouped GEMMs over pairs grouped by expert (``moe._align_fused``'s layout), each weight tile's codes
  converted to x's dtype inside the kernel (exact), the tile's dot accumulated in fp32 and scaled per group
  (groupwise) or per row (fp8) in fp32 -- the decoded weight's value without a rounded bf16 copy of it. nvfp4
  tiles carry their block scales (``e2m1 * block scale`` is exact in x's dtype, as in the dense nvfp4 GEMM), and
  the sum is divided by the bank's divisor once, after the whole K. The
  SwiGLU activation is rounded to x.dtype for the down GEMM's tensor-core operand (as the bf16 kernels do; the
  reference keeps it in fp32), the routed partial sums are written per pair in fp32 and summed in j order with
  the shared expert's fp32 term (its down projection run by the same down kernel as a one-expert bank).

Limits: x is bf16, fp16 or fp32 and a dense operand has x's dtype (otherwise the reference op runs). Routing ids
are trusted to lie in [0, E), as in the bf16 op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.ops.contracts import SharedExpert
from ninfer.ops.reference import quantized as _reference
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton import moe_gemv, quant_moe_gemv
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, TL_DTYPE, cast, mm
from ninfer.ops.triton._quant import KERNEL_FORMATS
from ninfer.ops.triton._quant_tiles import Operand, operand, tile_codes, tile_scales
from ninfer.ops.triton.moe import _align_fused, _block_m
from ninfer.quant import PackedWeight


@triton.jit
def _gemm_tile(acc, a, w0, w1, w2, s0, s1, s2, rows, c, K, FMT: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, DT: tl.constexpr, FP32_DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ W[rows, chunk c]^T, scaled per group for groupwise formats (fp8's row scale and nvfp4's divisor
    come later; nvfp4's block scales are in its tile)."""
    w = tile_codes(w0, w1, w2, s0, s1, s2, rows, c, K, FMT, BN, BK, DT)
    if FMT == 0 or FMT == 1 or FMT == 2:
        acc += mm(a, tl.trans(w), FP32_DOT, INTERP)
    else:
        acc += mm(a, tl.trans(w), FP32_DOT, INTERP) * tile_scales(w2, s2, rows, c)[None, :]
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, pair_ptr, bexp_ptr, act_ptr, w0, w1, w2, s0, s1, s2, H, NI, TK, E, NCHUNK, sx_t,
                    FMT: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    DT: tl.constexpr, FP32_DOT: tl.constexpr, INTERP: tl.constexpr):
    pm = tl.program_id(0)
    e = tl.load(bexp_ptr + pm)
    if e < E:  # blocks past the used ones have no expert
        m = pm * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + m)
        tok = tl.where(pair < TK, pair // TOPK, 0)     # padding rows read token 0; their rows are never used
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        g_rows = e * (2 * NI) + tl.minimum(n, NI - 1)
        u_rows = g_rows + NI
        kk = tl.arange(0, BK)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(0, NCHUNK):
            k = c * BK + kk
            a = tl.load(x_ptr + tok[:, None] * sx_t + k[None, :], mask=(k < H)[None, :], other=0.0)
            acc_g = _gemm_tile(acc_g, a, w0, w1, w2, s0, s1, s2, g_rows, c, H, FMT, BN, BK, DT, FP32_DOT, INTERP)
            acc_u = _gemm_tile(acc_u, a, w0, w1, w2, s0, s1, s2, u_rows, c, H, FMT, BN, BK, DT, FP32_DOT, INTERP)
        if FMT == 1:
            acc_g *= tile_scales(w2, s2, g_rows, 0)[None, :]
            acc_u *= tile_scales(w2, s2, u_rows, 0)[None, :]
        elif FMT == 2:
            acc_g = acc_g / tl.load(w1)
            acc_u = acc_u / tl.load(w1)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + m[:, None] * NI + n[None, :], cast(act, DT, INTERP), mask=(n < NI)[None, :])


@triton.jit
def _down_kernel(act_ptr, pair_ptr, bexp_ptr, rw_ptr, y_ptr, w0, w1, w2, s0, s1, s2, NI, H, TK, E, NCHUNK,
                 FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                 ACT_BY_PAIR: tl.constexpr, FP32_DOT: tl.constexpr, INTERP: tl.constexpr):
    # y[pair] = rw[pair] * act[row] @ W_e^T in fp32; act rows by padded position (routed experts, written so by
    # the gate/up kernel) or by pair (the shared expert's [T, Is] activations).
    pm = tl.program_id(0)
    e = tl.load(bexp_ptr + pm)
    if e < E:
        m = pm * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + m)
        valid = pair < TK
        if ACT_BY_PAIR:
            arow = tl.where(valid, pair, 0)
        else:
            arow = m
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        rows = e * H + tl.minimum(n, H - 1)
        kk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(0, NCHUNK):
            k = c * BK + kk
            a = tl.load(act_ptr + arow[:, None] * NI + k[None, :], mask=(k < NI)[None, :], other=0.0)
            acc = _gemm_tile(acc, a, w0, w1, w2, s0, s1, s2, rows, c, NI, FMT, BN, BK, DT, FP32_DOT, INTERP)
        if FMT == 1:
            acc *= tile_scales(w2, s2, rows, 0)[None, :]
        elif FMT == 2:
            acc = acc / tl.load(w1)
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
        tl.store(y_ptr + pair[:, None] * H + n[None, :], acc * rw[:, None], mask=valid[:, None] & (n < H)[None, :])


@triton.jit
def _sum_kernel(y_ptr, extra_ptr, out_ptr, H, so_t, TOPK: tl.constexpr, BH: tl.constexpr,
                HAS_EXTRA: tl.constexpr, ODT: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BH + tl.arange(0, BH)
    nm = n < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * H + n, mask=nm, other=0.0)
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + t * H + n, mask=nm, other=0.0)
    tl.store(out_ptr + t * so_t + n, cast(acc, ODT, INTERP), mask=nm)


def _block_k(op: Operand) -> tuple[int, int]:
    """(BK, K chunks): a groupwise chunk is one group; fp8 and dense take 64 lanes, nvfp4 one 64-lane
    scale-tile column."""
    if op.grouped:
        return (32 if op.fmt == 8 else 64), op.slots
    return 64, triton.cdiv(op.k, 64)


def _grouped_down(act, pairs, block_expert, max_blocks, bm, rw, y, op: Operand, n_exp, tk, by_pair, dt, kw):
    hidden, inter = op.rows, op.k
    bk, nch = _block_k(op)
    bn = 64 if max_blocks <= 32 else 128
    _down_kernel[(max_blocks, triton.cdiv(hidden, bn))](
        act, pairs, block_expert, rw, y, *op.args(), inter, hidden, tk, n_exp, nch,
        FMT=op.fmt, BM=bm, BN=bn, BK=bk, DT=TL_DTYPE[dt], ACT_BY_PAIR=by_pair,
        FP32_DOT=dt == torch.float32, INTERP=INTERPRET, **kw)


def _grouped(x, weights, ids, n_exp: int, gu: Operand, dn: Operand, shared: SharedExpert | None,
             sh: Operand | None) -> torch.Tensor:
    t_len, hidden = x.shape
    top_k = ids.shape[1]
    inter = dn.k
    out = torch.empty((t_len, hidden), dtype=x.dtype, device=x.device)
    tk = t_len * top_k
    bm = _block_m(tk, n_exp)
    pairs, block_expert, max_blocks = _align_fused(ids, n_exp, bm)
    dt = x.dtype
    # fp32 tiles are twice the shared memory of 16-bit ones: one stage fewer.
    kw = {} if INTERPRET else {"num_warps": 4, "num_stages": 2 if dt == torch.float32 else 3}
    act = torch.empty((max_blocks * bm, inter), dtype=dt, device=x.device)
    bk, nch = _block_k(gu)
    bn = 32 if max_blocks <= 32 else 64
    _gate_up_kernel[(max_blocks, triton.cdiv(inter, bn))](
        x, pairs, block_expert, act, *gu.args(), hidden, inter, tk, n_exp, nch, x.stride(0),
        FMT=gu.fmt, TOPK=top_k, BM=bm, BN=bn, BK=bk, DT=TL_DTYPE[dt], FP32_DOT=dt == torch.float32,
        INTERP=INTERPRET, **kw)
    y = torch.empty((tk, hidden), dtype=torch.float32, device=x.device)
    rw = weights.reshape(-1).float().contiguous()
    _grouped_down(act, pairs, block_expert, max_blocks, bm, rw, y, dn, n_exp, tk, False, dt, kw)
    extra = None
    if shared is not None:
        # The shared expert as a one-expert bank routed to by every token (row m of its blocks is token m, rows
        # past T are padding), its routing weight the sigmoid gate; the activation as the reference rounds it.
        s_inter = sh.k
        p = shared.projected.float()
        s_act = (F.silu(p[:, :s_inter]) * p[:, s_inter:]).to(dt).contiguous()
        s_blocks = triton.cdiv(t_len, bm)
        s_pairs = torch.arange(s_blocks * bm, dtype=torch.int64, device=x.device).clamp_(max=t_len)
        s_bexp = torch.zeros((s_blocks,), dtype=torch.int64, device=x.device)
        extra = torch.empty((t_len, hidden), dtype=torch.float32, device=x.device)
        gate = torch.sigmoid(shared.gate_logit.float()).contiguous()
        _grouped_down(s_act, s_pairs, s_bexp, s_blocks, bm, gate, extra, sh, 1, t_len, True, dt, kw)
    bh = min(1024, triton.next_power_of_2(hidden))
    _sum_kernel[(t_len, triton.cdiv(hidden, bh))](y, y if extra is None else extra, out, hidden, out.stride(0),
                                                  TOPK=top_k, BH=bh, HAS_EXTRA=extra is not None,
                                                  ODT=TL_DTYPE[dt], INTERP=INTERPRET)
    return out


def _check(x, weights, ids, gate_up, down, shared: SharedExpert | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [T, H], got shape {list(x.shape)}")
    t_len, hidden = x.shape
    if ids.dim() != 2 or ids.shape[0] != t_len or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"moe_experts: ids {list(ids.shape)} and weights {list(weights.shape)} must both be "
                         f"[T={t_len}, k]")
    if len(gate_up.shape) != 3 or len(down.shape) != 3:
        raise ValueError(f"moe_experts: gate_up {list(gate_up.shape)} and down {list(down.shape)} must be banks "
                         f"[E, 2I, H] and [E, H, I]")
    n_exp, two_i, h_in = gate_up.shape
    inter = two_i // 2
    if two_i % 2 or h_in != hidden or tuple(down.shape) != (n_exp, hidden, inter):
        raise ValueError(f"moe_experts: with x [T, {hidden}], gate_up {list(gate_up.shape)} needs [E, 2I, "
                         f"{hidden}] and down [E, {hidden}, I] = {[n_exp, hidden, inter]}, got {list(down.shape)}")
    if shared is not None:
        s_inter = shared.down.shape[-1]
        if (len(shared.down.shape) != 2 or shared.down.shape[0] != hidden
                or tuple(shared.projected.shape) != (t_len, 2 * s_inter)
                or tuple(shared.gate_logit.shape) != (t_len,)):
            raise ValueError(f"moe_experts: shared expert down {list(shared.down.shape)}, projected "
                             f"{list(shared.projected.shape)}, gate_logit {list(shared.gate_logit.shape)} must be "
                             f"[{hidden}, Is], [{t_len}, 2Is], [{t_len}]")


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor | PackedWeight,
                down: torch.Tensor | PackedWeight, *, shared: SharedExpert | None = None,
                gemv: bool | None = None) -> torch.Tensor:
    """Weighted sum of the routed experts' SwiGLU MLPs for ``x[T, H]`` (plus the shared expert when given), the
    banks packed or dense; returns [T, H] in x.dtype. ``gemv`` forces (True) or forbids (False) the decode path
    (None: by size)."""
    _check(x, weights, ids, gate_up, down, shared)
    dense = [w for w in (gate_up, down, None if shared is None else shared.down)
             if w is not None and not isinstance(w, PackedWeight)]
    if x.dtype not in KERNEL_DTYPES or any(w.dtype != x.dtype for w in dense):
        return _reference.moe_experts(x, weights, ids, gate_up, down, shared=shared)
    t_len, top_k = ids.shape
    if t_len == 0:
        return torch.empty_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    gu, dn = operand(gate_up, "gate_up"), operand(down, "down")
    sh = None
    if shared is not None:
        sh = operand(shared.down, "shared.down")
        if shared.projected.stride(-1) != 1:
            shared = SharedExpert(shared.projected.contiguous(), shared.down, shared.gate_logit)
    if gemv if gemv is not None else t_len * top_k <= moe_gemv.MAX_PAIRS:
        return quant_moe_gemv.moe_experts_gemv(x, weights, ids, gu, dn, shared, sh)
    return _grouped(x, weights, ids, gate_up.shape[0], gu, dn, shared, sh)


OPS = [
    OpImpl(op="moe_experts", name="triton", fn=moe_experts, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
           priority=10, weight_formats=KERNEL_FORMATS),
]
