"""Triton ``gdn_verify``: a GDN layer's speculative verify, every verify row's k + 1 tokens in one launch.

The composition it replaces is k + 1 ``gdn_decode`` launches per layer (token ``j`` of every row in launch ``j``),
after a staging copy of each row's live StateImage into its first snapshot, each launch reading back from global
memory the state the previous one wrote there. Here program (verify row i, value head h) loads the row's live
recurrent state and conv window once, then runs its ``counts[i]`` tokens in a loop with the state in registers,
storing the state after token ``j`` to snapshot ``snapshots[i, j]`` and token ``j``'s output into ``out``.

Per token the arithmetic is ``_decode_kernel``'s (:mod:`.gdn_decode`: the same conv, gates, recurrence and gated norm
functions on the same values), and the conv window carried from one token to the next is what ``_decode_kernel``
would have stored and reloaded (rounded to the activation dtype, then to the state dtype), so every output and
conv window equals the step-by-step composition's bit for bit, and so do the fp32 states in fp32 models; compiled
for bf16 inputs the loop's state arithmetic may be contracted differently from the one-step kernel's, moving the
last bits of some state elements (seen on the H200; the outputs stay bitwise equal).

No ticket: the live slot is only read, so the R programs of a key head may all read its q/k conv channels while
one of them (h % R == 0) writes the rolled window to the snapshots. PDL: before its wait a program reads the live
states, parameters and the row's indices, none of which the previous launch (the input projection) writes.

Conv widths other than 4 (no Qwen3.5 model has one) take the reference composition, which reads the counts on the
host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import (
    INTERPRET,
    KERNEL_DTYPES,
    TL_DTYPE,
    cast,
    launch_ok,
    next_pow2,
    pdl,
    pdl_wait,
)

from ninfer_qwen3_5.ops.contracts import GDNDecodeParams
from ninfer_qwen3_5.ops.reference import gdn as reference
from ninfer_qwen3_5.ops.triton.gdn_decode import (
    _check_heads,
    _head_lanes,
    _last_contig,
    _qkv_windows,
    _token_step,
)


@triton.jit
def _stored(u, x_dtype: tl.constexpr, s_dtype: tl.constexpr, INTERP: tl.constexpr):
    """What ``_conv4_store`` writes for a window entry: rounded to the activation dtype, then the state's."""
    return cast(cast(u, x_dtype, INTERP), s_dtype, INTERP)


@triton.jit(do_not_specialize_on_alignment=["starts_ptr", "counts_ptr", "live_ptr", "snaps_ptr"])
def _verify_kernel(x_ptr, z_ptr, a_ptr, b_ptr, cw_ptr, cs_ptr, st_ptr, scs_ptr, sst_ptr, starts_ptr, counts_ptr,
                   live_ptr, snaps_ptr, na_ptr, dt_ptr, nw_ptr, o_ptr, scale, eps, stride_xb, stride_zb, stride_zh,
                   stride_ab, stride_bb, stride_wc, stride_wk, stride_cs, stride_cc, stride_ck, stride_scs,
                   stride_scc, stride_sck, stride_ob, stride_oh, ss_s, ss_h, ss_k, sss_s, sss_h, sss_k, stride_snap,
                   R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, NW_DTYPE: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
                   SIGMOID: tl.constexpr):
    i, h, hk, dk, dv, dkm, dvm = _head_lanes(R, DK, DV, BK, BV)
    cq = hk * DK + dk
    ck = KEY_DIM + cq
    cv = 2 * KEY_DIM + h * DV + dv
    start = tl.load(starts_ptr + i)
    count = tl.load(counts_ptr + i)
    live = tl.load(live_ptr + i)
    smask = dkm[:, None] & dvm[None, :]
    s = tl.load(st_ptr + live * ss_s + h * ss_h + dk[:, None] * ss_k + dv[None, :], mask=smask, other=0.0)
    snap_tile = sst_ptr + h * sss_h + dk[:, None] * sss_k + dv[None, :]
    nw = tl.load(nw_ptr + dv, mask=dvm, other=0.0).to(tl.float32)
    (qw0, qw1, qw2, qw3, qu0, qu1, qu2, kw0, kw1, kw2, kw3, ku0, ku1, ku2, vw0, vw1, vw2, vw3, vu0, vu1,
     vu2) = _qkv_windows(cw_ptr, cs_ptr, live, cq, ck, cv, dkm, dvm, stride_wc, stride_wk, stride_cs, stride_cc,
                         stride_ck)
    na = tl.load(na_ptr + h)
    dt = tl.load(dt_ptr + h)
    x_dt: tl.constexpr = x_ptr.dtype.element_ty
    s_dt: tl.constexpr = scs_ptr.dtype.element_ty
    pdl_wait(PDL)
    for j in range(0, count):
        r = start + j
        snap = tl.load(snaps_ptr + i * stride_snap + j)
        s, x_q, x_k, x_v = _token_step(
            x_ptr, z_ptr, a_ptr, b_ptr, scs_ptr, o_ptr, r, snap, h, cq, ck, cv, dk, dv, dkm, dvm, h, 0,   # h % R == 0 writes q/k
            qw0, qw1, qw2, qw3, qu0, qu1, qu2, kw0, kw1, kw2, kw3, ku0, ku1, ku2, vw0, vw1, vw2, vw3, vu0, vu1, vu2,
            s, snap_tile + snap * sss_s, smask, na, dt, nw, scale, eps, stride_xb, stride_zb, stride_zh, stride_ab,
            stride_bb, stride_scs, stride_scc, stride_sck, stride_ob, stride_oh, R, DV, NW_DTYPE, INTERP, SIGMOID)
        # The window the next token reads: what this token's stores wrote.
        qu0, qu1, qu2 = _stored(qu1, x_dt, s_dt, INTERP), _stored(qu2, x_dt, s_dt, INTERP), cast(x_q, s_dt, INTERP)
        ku0, ku1, ku2 = _stored(ku1, x_dt, s_dt, INTERP), _stored(ku2, x_dt, s_dt, INTERP), cast(x_k, s_dt, INTERP)
        vu0, vu1, vu2 = _stored(vu1, x_dt, s_dt, INTERP), _stored(vu2, x_dt, s_dt, INTERP), cast(x_v, s_dt, INTERP)


def gdn_verify(mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: GDNDecodeParams,
               conv_states: torch.Tensor, states: torch.Tensor, snap_conv: torch.Tensor, snap_states: torch.Tensor,
               starts: torch.Tensor, counts: torch.Tensor, live_slots: torch.Tensor, snapshots: torch.Tensor,
               out: torch.Tensor, *, num_warps: int = 4) -> None:
    """Every verify row's tokens through the GDN decode tail into its snapshots, one launch (contract
    ``gdn_verify``)."""
    launch_ok(mixed)
    p = params
    n, channels = mixed.shape
    hv, dv, hk, dk = p.value_heads, p.value_dim, p.key_heads, p.key_dim
    _check_heads("gdn_verify", channels, p)
    v_rows = starts.shape[0]
    if counts.shape != (v_rows,) or live_slots.shape != (v_rows,) or snapshots.dim() != 2 \
            or snapshots.shape[0] != v_rows:
        raise ValueError(f"gdn_verify: {v_rows} verify rows need {v_rows} counts, live slots and snapshot rows, "
                         f"got {tuple(counts.shape)}, {tuple(live_slots.shape)}, {tuple(snapshots.shape)}")
    if states.dtype != torch.float32 or snap_states.dtype != torch.float32 or states.stride(-1) != 1 \
            or snap_states.stride(-1) != 1:
        raise ValueError("gdn_verify: states and snapshot states must be fp32 with a contiguous last dim")
    if snap_conv.dtype != conv_states.dtype:
        raise ValueError(f"gdn_verify: snapshot conv states are {snap_conv.dtype}, live ones {conv_states.dtype}")
    if out.shape != (n, hv, dv) or out.stride(-1) != 1:
        raise ValueError(f"gdn_verify: out must be [{n}, {hv}, {dv}] with a contiguous last dim, got "
                         f"{tuple(out.shape)}")
    if v_rows == 0:
        return
    if p.conv_weight.shape[-1] != 4:
        reference.gdn_verify(mixed, z, a, b, p, conv_states, states, snap_conv, snap_states, starts, counts,
                             live_slots, snapshots, out)
        return
    mixed, z, a, b = _last_contig(mixed), _last_contig(z), _last_contig(a), _last_contig(b)
    index = [t.to(device=mixed.device, dtype=torch.int64) for t in (starts, counts, live_slots)]
    snaps = snapshots.to(device=mixed.device, dtype=torch.int64)
    neg_a, dt_bias = p.neg_a.float().contiguous(), p.dt_bias.float().contiguous()
    nw = p.norm_weight.contiguous()
    # The kernel reads these before its PDL wait: one just made by a conversion would be the previous launch.
    converted = (any(t is not s for t, s in zip(index, (starts, counts, live_slots), strict=True))
                 or snaps is not snapshots or neg_a is not p.neg_a or dt_bias is not p.dt_bias
                 or nw is not p.norm_weight)
    _verify_kernel[(v_rows, hv)](
        mixed, z, a, b, p.conv_weight, conv_states, states, snap_conv, snap_states, *index, snaps, neg_a, dt_bias,
        nw, out, float(p.scale), float(p.eps), mixed.stride(0), z.stride(0), z.stride(1), a.stride(0), b.stride(0),
        *p.conv_weight.stride(), *conv_states.stride(), *snap_conv.stride(), out.stride(0), out.stride(1),
        *states.stride()[:3], *snap_states.stride()[:3], snaps.stride(0),
        R=hv // hk, DK=dk, DV=dv, KEY_DIM=hk * dk, BK=next_pow2(dk), BV=next_pow2(dv),
        NW_DTYPE=TL_DTYPE[torch.promote_types(mixed.dtype, p.norm_weight.dtype)], INTERP=INTERPRET,
        SIGMOID=p.sigmoid_gate, **({} if INTERPRET else {"num_warps": num_warps}),
        **({"PDL": False} if converted else pdl(mixed)))


OPS = [OpImpl(op="gdn_verify", name="triton", fn=gdn_verify, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
              priority=10)]
