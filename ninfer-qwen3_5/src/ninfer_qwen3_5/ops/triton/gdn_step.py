"""Triton Gated DeltaNet, one token at a time: ``gdn_recurrent_step`` (the decode step of rows against their
StateImage slots) and :func:`run_one_token`, the same update for a one-token call of the chunked prefill and for the
one-token sequences of a VARLEN call (:mod:`ninfer_qwen3_5.ops.triton.gdn`, which chunks everything else).

Per value head j with key head j // (Hv / Hk), q and k L2-normalised in fp32 (eps 1e-6 inside the rsqrt), q scaled,
then  S <- e^g S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q  (:func:`recurrent_update`; the fused
decode kernel of :mod:`~ninfer_qwen3_5.ops.triton.gdn_decode` uses it too). All arithmetic is fp32 and
memory-bound, so the reductions are IEEE. States are read and written in place, except that a decode step writes
``states[out_slots[b]]`` when given (lookahead decode); slot ids are read on the device (no host synchronisation,
graph-capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import pdl, pdl_wait

# The one-token kernel's Dv tile: fixed (not by the call's size), so a token gets the same bits in either form.
_ONE_BV = 64


def _pow2(n: int, lo: int = 16) -> int:
    # tl.dot needs every block dim >= 16; tl.arange needs powers of two.
    return max(lo, triton.next_power_of_2(n))


def _interpreting(t: torch.Tensor) -> bool:
    # Under TRITON_INTERPRET=1 tensors live on the CPU and num_warps etc. are ignored.
    return t.device.type != "cuda"


def _check_heads(hk: int, hv: int) -> int:
    if hv % hk:
        raise ValueError(f"GDN: value heads {hv} are not a multiple of key heads {hk}")
    return hv // hk


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def recurrent_update(s, q, k, v, g, beta, scale):
    """One token of the recurrence on a [Dk, BV] state tile (fp32; q/k raw, v/g/beta of the tile's head):
    returns (new tile, o tile). q and k are L2-normalised here: each Dv tile recomputes the (cheap) norms of its
    row's q/k rather than passing them between programs."""
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    s = s * tl.exp(g)
    kv = tl.sum(k[:, None] * s, 0)                       # S^T k over the already-decayed state
    delta = beta * (v - kv)
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(q[:, None] * s, 0)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "out_slot_ptr"])
def _gdn_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, st_ptr, slot_ptr, out_slot_ptr, o_ptr, scale,
                     sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sb_b, sb_h, so_b, so_h,
                     ss_s, ss_h, ss_k,
                     R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // R
    dk = tl.arange(0, BK)
    dv = vb * BV + tl.arange(0, BV)
    dkm = dk < DK
    dvm = dv < DV
    q = tl.load(q_ptr + b * sq_b + hk * sq_h + dk, mask=dkm, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + hk * sk_h + dk, mask=dkm, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + dv, mask=dvm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * sg_b + h * sg_h).to(tl.float32)
    beta = tl.load(b_ptr + b * sb_b + h * sb_h).to(tl.float32)
    # The slot id is read here (int64), never on the host: no sync, and slot * stride cannot overflow int32.
    slot = tl.load(slot_ptr + b)
    s_ptrs = st_ptr + slot * ss_s + h * ss_h + dk[:, None] * ss_k + dv[None, :]
    smask = dkm[:, None] & dvm[None, :]
    s, o = recurrent_update(tl.load(s_ptrs, mask=smask, other=0.0), q, k, v, g, beta, scale)
    out_slot = tl.load(out_slot_ptr + b)
    tl.store(s_ptrs + (out_slot - slot) * ss_s, s, mask=smask)
    tl.store(o_ptr + b * so_b + h * so_h + dv, o.to(o_ptr.dtype.element_ty), mask=dvm)


@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "slot_ptr"])
def _gdn_one_token_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, st_ptr, cu_ptr, slot_ptr, o_ptr, scale,
                          sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h, ss_s, ss_h, ss_k,
                          R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          VARLEN: tl.constexpr):
    # Program (sequence i, value head, Dv tile). VARLEN: sequence i of the call (``cu_ptr``), stepped only when it is
    # one token long, from and into ``states[slot_ptr[i]]``; otherwise the call's one token and ``st_ptr`` its state.
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    t = i * 0
    n = i * 0 + 1
    if VARLEN:
        t = tl.load(cu_ptr + i)
        n = tl.load(cu_ptr + i + 1) - t
        st_ptr += tl.load(slot_ptr + i).to(tl.int64) * ss_s
    if n == 1:
        hk = h // R
        dk = tl.arange(0, BK)
        dv = vb * BV + tl.arange(0, BV)
        dkm = dk < DK
        dvm = dv < DV
        t64 = t.to(tl.int64)
        q = tl.load(q_ptr + t64 * sq_t + hk * sq_h + dk, mask=dkm, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * sk_t + hk * sk_h + dk, mask=dkm, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * sv_t + h * sv_h + dv, mask=dvm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * sg_t + h * sg_h).to(tl.float32)
        beta = tl.load(b_ptr + t64 * sb_t + h * sb_h).to(tl.float32)
        s_ptrs = st_ptr + h * ss_h + dk[:, None] * ss_k + dv[None, :]
        smask = dkm[:, None] & dvm[None, :]
        s, o = recurrent_update(tl.load(s_ptrs, mask=smask, other=0.0), q, k, v, g, beta, scale)
        tl.store(s_ptrs, s, mask=smask)
        tl.store(o_ptr + t64 * so_t + h * so_h + dv, o.to(o_ptr.dtype.element_ty), mask=dvm)


def gdn_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, scale: float,
                       out_slots: torch.Tensor | None = None, *, block_v: int | None = None) -> torch.Tensor:
    """One token per row ``b`` against ``states[slots[b]]`` ([S, Hv, Dk, Dv] fp32); the new state goes to
    ``states[out_slots[b]]`` (default: ``slots``, in place)."""
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    r = _check_heads(hk, hv)
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        raise ValueError("gdn_recurrent_step: states must be fp32 with a contiguous last dim")
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    slots = slots if slots.dtype == torch.int64 else slots.to(torch.int64)
    out_slots = slots if out_slots is None else (out_slots if out_slots.dtype == torch.int64
                                                  else out_slots.to(torch.int64))
    o = torch.empty((bsz, hv, dv), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return o
    bk = _pow2(dk, 2)
    # A [Dk, BV] state tile per program: with few rows a narrow tile puts more programs in flight; with many, a
    # wide tile moves more bytes per program (tools/bench_triton_gdn_moe.py sweeps block_v).
    bv = block_v or (64 if bsz * hv >= 64 else 16)
    bv = min(bv, _pow2(dv, 2))
    grid = (bsz, hv, triton.cdiv(dv, bv))
    _gdn_step_kernel[grid](
        q, k, v, g, beta, states, slots, out_slots, o, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        R=r, DK=dk, DV=dv, BK=bk, BV=bv, num_warps=4, **pdl(q))
    return o


def run_one_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  o: torch.Tensor, state: torch.Tensor, scale: float, *, r: int, cu: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> None:
    """One recurrence step: of the call's one token (``state[Hv, Dk, Dv]``), or, with ``cu`` and ``slots``, of each of
    the sequences they describe that is one token long (``state[S, Hv, Dk, Dv]``; the chunk kernels skip those). The
    tile width is fixed, so both forms give a token the same bits."""
    hv, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    bv = min(_ONE_BV, _pow2(dv, 2))
    varlen = cu is not None
    strides = state.stride()[:3] if varlen else (0, *state.stride()[:2])
    _gdn_one_token_kernel[(slots.shape[0] if varlen else 1, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state, cu if varlen else g, slots if varlen else g, o, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), *strides,
        R=r, DK=dk, DV=dv, BK=_pow2(dk, 2), BV=bv, VARLEN=varlen, num_warps=4)


_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

OPS = [
    OpImpl(op="gdn_recurrent_step", name="triton", fn=gdn_recurrent_step, devices=frozenset({"cuda"}),
           dtypes=_DTYPES, priority=10),
]
