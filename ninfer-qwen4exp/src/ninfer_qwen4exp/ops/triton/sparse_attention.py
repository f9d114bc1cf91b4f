"""Triton QSA, the sparse attention: ``qsa_attention``, each query over the positions the indexer selected for it
(:mod:`.indexer`), for prefill and decode, with no host synchronisation (CUDA-graph safe).

Program (query, KV head, split): the R query heads of one KV head (a ``BLOCK_H >= 16`` tile,
so each gathered K/V tile serves the whole GQA group) over one run of the query's ``sel`` entries, gathering each
listed position through the row's page table; an online softmax in base 2, fp32 scores and accumulation, as
core's paged attention (``ninfer.ops.triton.attention``). Entries that are ``-1`` or not below the row's KV length
are masked (never read), so garbage in a row's unused entries cannot reach memory it does not own.

- A call with one query per row (``q.shape[0] == rows``: decode rows) cuts each query's entries into runs of
  :data:`SPLIT_ENTRIES` (flash-decoding: a decode step has too few queries to fill the device) and a combine
  kernel merges them in run order; the probabilities enter ``P @ V`` as a hi + lo pair of the KV dtype (core's
  decode practice). Any other call (prefill chunks) runs one program per (query, KV head) over all its entries and
  rounds the probabilities once to the KV dtype (core's prefill practice). The partition is a function of the
  selection's width only, so a query's arithmetic never depends on the other queries of its call.
- Row of a query: found on the device from ``cu_q`` (the count of rows whose queries all come before it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, mm, next_pow2

from ninfer_qwen4exp.ops.triton.rows import query_position, row_metadata

_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)   # the running max's start: finite, so a fully masked run never forms inf - inf

#: Selected positions per program when a call has one query per row (decode).
SPLIT_ENTRIES = 64
#: Most fp32 partial values one split attention launch writes (queries are taken in chunks beyond it).
PARTIAL_ELEMENTS = 1 << 24


@triton.jit
def _gated(out, gate_ptr, DT: tl.constexpr, INTERP: tl.constexpr, HAS_GATE: tl.constexpr, mask):
    """``out`` (fp32), times ``sigmoid(gate)`` as torch computes ``o * sigmoid(gate)`` in DT (o and the sigmoid each
    rounded to DT; the caller's store rounds the product) when HAS_GATE."""
    if HAS_GATE:
        g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
        out = cast(out, DT, INTERP).to(tl.float32) * cast(1.0 / (1.0 + tl.exp(-g)), DT, INTERP).to(tl.float32)
    return out


@triton.jit(do_not_specialize=["n_rows", "t0", "stride_ptb"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, sel_ptr, cu_q_ptr, kv_lens_ptr, pt_ptr, acc_ptr, ml_ptr, out_ptr, gate_ptr,
                 qk_scale, n_rows, t0,
                 stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb,
                 stride_st, stride_at, stride_ah, stride_as, stride_mt, stride_mh, stride_ms, stride_ot, stride_oh,
                 stride_gt,
                 R: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, WIDTH: tl.constexpr, PER: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 DIRECT: tl.constexpr, P_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, INTERP: tl.constexpr,
                 HAS_GATE: tl.constexpr):
    """Program (query of the chunk, KV head, run of entries): the GQA group's heads over the run (module docstring);
    DIRECT: the one run of all entries, stored normalised; else unnormalised partials (acc, m, l)."""
    tq = tl.program_id(0)
    t = t0 + tq
    g = tl.program_id(1)
    s = tl.program_id(2)
    b, kv_len, _ = query_position(cu_q_ptr, kv_lens_ptr, t, n_rows, BLOCK_B)
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = hh < R
    dm = d < D
    heads = g * R + hh
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hm[:, None] & dm[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lo = s * PER
    hi = tl.minimum(lo + PER, WIDTH)
    for e0 in range(lo, hi, BLOCK_N):
        e = e0 + tl.arange(0, BLOCK_N)
        pos = tl.load(sel_ptr + t * stride_st + e, mask=e < hi, other=-1)
        valid = (pos >= 0) & (pos < kv_len)
        pos = tl.where(valid, pos, 0)
        page = tl.load(pt_ptr + b * stride_ptb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        slot = (pos % PAGE).to(tl.int64)
        kvm = valid[:, None] & dm[None, :]
        k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks + g * stride_kh)[:, None] + d[None, :], mask=kvm,
                    other=0.0)
        v = tl.load(v_ptr + (page * stride_vp + slot * stride_vs + g * stride_vh)[:, None] + d[None, :], mask=kvm,
                    other=0.0)
        scores = tl.where(valid[None, :], mm(q, tl.trans(k), FP32_DOT, INTERP) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_hi = cast(p, v.dtype, INTERP)
        pv = mm(p_hi, v, FP32_DOT, INTERP)
        if P_SPLIT:   # p as hi + lo of V's dtype: ~16 significant bits instead of 8
            pv += mm(cast(p - p_hi.to(tl.float32), v.dtype, INTERP), v, FP32_DOT, INTERP)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    om = hm[:, None] & dm[None, :]
    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = _gated(out, gate_ptr + t * stride_gt + heads[:, None] * D + d[None, :], out_ptr.dtype.element_ty, INTERP,
                     HAS_GATE, om)
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 cast(out, out_ptr.dtype.element_ty, INTERP), mask=om)
    else:
        base = tq * stride_at + heads * stride_ah + s * stride_as
        tl.store(acc_ptr + base[:, None] + d[None, :], acc, mask=om)
        mb = tq * stride_mt + heads * stride_mh + s * stride_ms
        tl.store(ml_ptr + mb, m_i, mask=hm)
        tl.store(ml_ptr + mb + 1, l_i, mask=hm)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, out_ptr, gate_ptr, t0, stride_at, stride_ah, stride_as, stride_mt, stride_mh,
                    stride_ms, stride_ot, stride_oh, stride_gt, D: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr, HAS_GATE: tl.constexpr):
    """Program (query of the chunk, query head): merges the runs in run order (a fixed order)."""
    tq = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sm = sp < SPLITS
    mb = tq * stride_mt + h * stride_mh + sp * stride_ms
    m = tl.load(ml_ptr + mb, mask=sm, other=_NEG)
    l_s = tl.load(ml_ptr + mb + 1, mask=sm, other=0.0)
    m_max = tl.max(m, 0)
    l_tot = tl.sum(tl.exp2(m - m_max) * l_s, 0)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, SPLITS):
        m_s = tl.load(ml_ptr + tq * stride_mt + h * stride_mh + s * stride_ms)
        part = tl.load(acc_ptr + tq * stride_at + h * stride_ah + s * stride_as + d, mask=dm, other=0.0)
        acc = acc + tl.exp2(m_s - m_max) * part
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)
    out = _gated(out, gate_ptr + (t0 + tq) * stride_gt + h * D + d, out_ptr.dtype.element_ty, INTERP, HAS_GATE, dm)
    tl.store(out_ptr + (t0 + tq) * stride_ot + h * stride_oh + d, cast(out, out_ptr.dtype.element_ty, INTERP), mask=dm)


def qsa_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, sel: torch.Tensor,
                  cu_q: torch.Tensor, kv_lens: torch.Tensor, page_tables: torch.Tensor, scale: float,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over the positions its ``sel`` row lists (the contract; module docstring); with
    ``gate[T, Hq*D]`` (row-strided allowed), times ``sigmoid(gate)`` where the output is stored."""
    launch_ok(q)
    t, hq, dh = q.shape
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    if hq % hkv:
        raise ValueError(f"qsa_attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if dh > 256 or k_pool.shape[3] != dh or v_pool.shape != k_pool.shape or k_pool.stride(-1) != 1 \
            or v_pool.stride(-1) != 1:
        raise ValueError(f"qsa_attention: head dim {dh} (<= 256) must match pools {tuple(k_pool.shape)} with a "
                         f"contiguous last dim")
    if sel.dim() != 2 or sel.shape[0] != t:
        raise ValueError(f"qsa_attention: sel {tuple(sel.shape)} must be [{t}, S]")
    if gate is not None and (gate.shape != (t, hq * dh) or gate.dtype != q.dtype):
        raise ValueError(f"qsa_attention: gate {tuple(gate.shape)} {gate.dtype} must be [rows, Hq*D] = "
                         f"{(t, hq * dh)} {q.dtype}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    width = sel.shape[1]
    if t == 0 or width == 0:   # nothing selected: zeros (gated zeros too)
        return out.zero_()
    cu_q, kv_lens, page_tables, n_rows = row_metadata(q, cu_q, kv_lens, page_tables)
    q = q if q.stride(-1) == 1 else q.contiguous()
    sel = sel.to(device=q.device, dtype=torch.int64).contiguous()
    r, block_d = hq // hkv, max(16, next_pow2(dh))
    wide = q.dtype == torch.float32
    block_n = 32 if block_d * (4 if wide else 2) > 256 else 64
    per = SPLIT_ENTRIES if t == n_rows else triton.cdiv(width, block_n) * block_n
    splits = triton.cdiv(width, per)
    direct = splits == 1
    chunk = t if direct else max(1, PARTIAL_ELEMENTS // (hq * splits * block_d))
    launch = dict(R=r, D=dh, PAGE=page, WIDTH=width, PER=per, BLOCK_B=next_pow2(n_rows), BLOCK_H=max(16, next_pow2(r)),
                  BLOCK_D=block_d, BLOCK_N=block_n, DIRECT=direct, P_SPLIT=not direct and not wide, FP32_DOT=wide,
                  INTERP=INTERPRET, HAS_GATE=gate is not None, num_warps=8 if wide and block_d > 128 else 4)
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    g, sg = (gate, gate.stride(0)) if gate is not None else (out, 0)
    for t0 in range(0, t, chunk):
        tc = min(chunk, t - t0)
        if direct:
            acc = ml = out
            sa = (0, 0, 0, 0, 0, 0)
        else:
            acc = torch.empty((tc, hq, splits, block_d), dtype=torch.float32, device=q.device)
            ml = torch.empty((tc, hq, splits, 2), dtype=torch.float32, device=q.device)
            sa = acc.stride()[:3] + ml.stride()[:3]
        _attn_kernel[(tc, hkv, splits)](
            q, k_pool, v_pool, sel, cu_q, kv_lens, page_tables, acc, ml, out, g, scale * _LOG2E, n_rows, t0,
            q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3], page_tables.stride(0),
            sel.stride(0), *sa, out.stride(0), out.stride(1), sg, **launch)
        if not direct:
            _combine_kernel[(tc, hq)](acc, ml, out, g, t0, *sa, out.stride(0), out.stride(1), sg, D=dh, SPLITS=splits,
                                      BLOCK_S=next_pow2(splits), BLOCK_D=block_d, INTERP=INTERPRET,
                                      HAS_GATE=gate is not None, num_warps=4)
    return out


OPS = [
    OpImpl(op="qsa_attention", name="triton", fn=qsa_attention, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
           priority=10),
]
