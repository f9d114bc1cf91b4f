"""Triton ``gdn_decode``: a Gated DeltaNet layer's decode step after its input projection, in one launch.

The composition it replaces (``gdn_gates`` -> ``causal_conv1d_update`` -> ``gdn_recurrent_step`` ->
``gated_rms_norm``) is four launches per GDN layer per step whose time is nearly all launch and dependency
latency: the whole step moves ~4 MB (the recurrent state, read and written) at the 35B-A3B shape.

``_decode_kernel`` (conv width 4, every Qwen3.5 model) -- program (row, value head h). Before the PDL wait it loads
its whole [Dk, Dv] state, the parameters (norm weight, gate constants) and the conv taps and old conv inputs of the
channels it reads: its key head's q and k channels and its own v channels (the states were last written by this
layer's previous step). After the wait, everything the input projection (the previous launch) wrote: x for those
channels, z, a and b. Then the conv + SiLU (rounded to x.dtype, as
``causal_conv1d_update`` returns it), the head's gates, the recurrence
(:func:`~ninfer_qwen3_5.ops.triton.gdn_step.recurrent_update`), o rounded to x.dtype, and the gated RMSNorm over the head
(:func:`~ninfer_qwen3_5.ops.triton.gated_norm.gated_norm_rows`). A program owns a whole head because the norm is over Dv.

The q/k conv channels of a key head feed its R value heads, and the conv state is updated in place: the R programs
all compute the same q/k conv outputs, and the rolled q/k state may only be written once all R have read the old
one. A per-(slot, key head) ticket elects the writer without any program waiting: each program, after a barrier that
ends its threads' reads of the old state, adds 1 to the ticket (acq_rel, before its PDL wait, so the atomic's round
trip overlaps the wait); the one that gets R - 1 modulo R read last and writes the state, then subtracts R. Between
launches every count is a multiple of R; a launch's increments all precede the next launch's (a kernel starts early
only once every program of the previous one passed its wait), and the late subtraction commutes with them. The
counters (``_tickets``) are made once per conv-state pool size, head layout and device, by an eager call (the decode
graphs' warm-up; a call that would have to make them inside a graph capture warns and takes the two-launch path),
and shared by the GDN layers, whose launches are stream-ordered. One launch instead of the two below: at decode the
launches, not the bytes, are the cost (``tools/gpu_decode_fusion_sweep.py --gdn-only`` compares them; the
end-to-end gain is in docs/dev/perf-log.md).

Other conv widths take the two-launch path (``one_kernel=False`` forces it, for comparisons):
1. ``_conv_gates_kernel`` -- program (row, block of channels): the causal conv + SiLU of its channels (the
   taps and old conv state are loaded before the PDL wait), and, in the programs of channel block 0, the
   row's gates. Writes the conv output y (x.dtype) and fp32 g, beta. Its launch boundary orders the last read of
   the old conv state before its overwrite.
2. ``_step_norm_kernel`` -- the recurrence and norm of ``_decode_kernel``, reading y, g and beta.

Invariants: those of the four ops it composes (contract ``gdn_decode``); rows are independent; only the rows'
own slots are read and their out slots written. The result equals the composition of the four Triton ops up to
reduction orders (the conv's taps, the recurrence's tiles, the norm); the one- and two-launch paths share the
recurrence and norm code and differ only in the conv's tap sum (a [C, K] tile's ``tl.sum`` against a sequential
chain: a last-bit difference in q, k, v at most). The conv states, copies of inputs, are bit-exact on both.
PDL precondition (both paths read the GDN and conv states before their wait): the launch before a call must not
write the rows' states -- in the model the input projection sits between two layers' calls; two in-place calls
back to back on the same slots would break it.
"""

from __future__ import annotations

import logging

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
from ninfer_qwen3_5.ops.triton.conv1d import conv_update_finish, conv_update_prologue
from ninfer_qwen3_5.ops.triton.gated_norm import gated_norm_rows
from ninfer_qwen3_5.ops.triton.gdn_gates import gates_math, gates_row
from ninfer_qwen3_5.ops.triton.gdn_step import recurrent_update

# Channels per conv program (the conv reads ~C * K * 2 bytes of taps; 8192 channels at 256 = 32 programs/row).
_BLOCK_C = 256


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "out_slots_ptr"])
def _conv_gates_kernel(x_ptr, w_ptr, s_ptr, slots_ptr, out_slots_ptr, y_ptr, a_ptr, b_ptr, na_ptr, dt_ptr,
                       g_ptr, beta_ptr, C, H, stride_xb, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
                       stride_yb, stride_ab, stride_bb, K: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_K: tl.constexpr, BH: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    slot = tl.load(slots_ptr + row).to(tl.int64)
    old, w = conv_update_prologue(w_ptr, s_ptr, slot, c, c_mask, stride_wc, stride_wk, stride_ss, stride_sc,
                                  stride_sk, K, BLOCK_K)
    out_slot = tl.load(out_slots_ptr + row).to(tl.int64)   # a step input, like slot
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_xb + c, mask=c_mask, other=0.0)
    if blk == 0:
        # The gates' loads go out with x's: after the conv's stores they were a second memory round trip in a row,
        # and this program is the one the kernel's end waits for.
        gates_row(a_ptr, b_ptr, na_ptr, dt_ptr, g_ptr, beta_ptr, row, H, stride_ab, stride_bb, BH)
    y = conv_update_finish(x, old, w, s_ptr, out_slot, c, c_mask, stride_ss, stride_sc, stride_sk, K, BLOCK_K,
                           INTERP)
    tl.store(y_ptr + row * stride_yb + c, cast(y, y_ptr.dtype.element_ty, INTERP), mask=c_mask)


@triton.jit
def _head_lanes(R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (row, value head h) of a step kernel: (row, h, its key head, the Dk and Dv lanes, their masks)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    return row, h, h // R, dk, dv, dk < DK, dv < DV


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "out_slots_ptr"])
def _step_norm_kernel(y_ptr, z_ptr, g_ptr, beta_ptr, st_ptr, slots_ptr, out_slots_ptr, nw_ptr, o_ptr, scale, eps,
                      H, stride_yb, stride_zb, stride_zh, stride_ob, stride_oh, ss_s, ss_h, ss_k,
                      R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, NW_DTYPE: tl.constexpr, INTERP: tl.constexpr,
                      PDL: tl.constexpr, SIGMOID: tl.constexpr):
    row, h, hk, dk, dv, dkm, dvm = _head_lanes(R, DK, DV, BK, BV)
    # Before the wait: nothing the conv/gates kernel writes (module docstring).
    slot = tl.load(slots_ptr + row)
    out_slot = tl.load(out_slots_ptr + row)   # a step input too: read here, not after the step's math
    s_ptrs = st_ptr + slot * ss_s + h * ss_h + dk[:, None] * ss_k + dv[None, :]
    smask = dkm[:, None] & dvm[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)
    z = tl.load(z_ptr + row * stride_zb + h * stride_zh + dv, mask=dvm, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + dv, mask=dvm, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    y_row = y_ptr + row * stride_yb
    q = tl.load(y_row + hk * DK + dk, mask=dkm, other=0.0).to(tl.float32)
    k = tl.load(y_row + KEY_DIM + hk * DK + dk, mask=dkm, other=0.0).to(tl.float32)
    v = tl.load(y_row + 2 * KEY_DIM + h * DV + dv, mask=dvm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * H + h)
    beta = tl.load(beta_ptr + row * H + h)
    s, o = recurrent_update(s, q, k, v, g, beta, scale)
    tl.store(s_ptrs + (out_slot - slot) * ss_s, s, mask=smask)
    # o rounded to the activation dtype (as gdn_recurrent_step returns it), then the gated norm over the head.
    o16 = cast(o, o_ptr.dtype.element_ty, INTERP).to(tl.float32)
    out = gated_norm_rows(o16[None, :], z[None, :], nw, eps, DV, o_ptr.dtype.element_ty, NW_DTYPE, INTERP, SIGMOID)
    tl.store(o_ptr + row * stride_ob + h * stride_oh + dv[None, :], cast(out, o_ptr.dtype.element_ty, INTERP),
             mask=dvm[None, :])


@triton.jit
def _conv4_load(cw_ptr, cs_ptr, slot, c, cm, stride_wc, stride_wk, stride_cs, stride_cc, stride_ck):
    """A width-4 conv's taps (fp32) and the row's three old inputs (state dtype), as 1-D vectors over channels c:
    the layout the recurrence reads q, k and v in, so no [channels, taps] tile needs converting."""
    w_base = cw_ptr + c * stride_wc
    s_base = cs_ptr + slot * stride_cs + c * stride_cc
    w0 = tl.load(w_base, mask=cm, other=0.0).to(tl.float32)
    w1 = tl.load(w_base + stride_wk, mask=cm, other=0.0).to(tl.float32)
    w2 = tl.load(w_base + 2 * stride_wk, mask=cm, other=0.0).to(tl.float32)
    w3 = tl.load(w_base + 3 * stride_wk, mask=cm, other=0.0).to(tl.float32)
    u0 = tl.load(s_base, mask=cm, other=0.0)
    u1 = tl.load(s_base + stride_ck, mask=cm, other=0.0)
    u2 = tl.load(s_base + 2 * stride_ck, mask=cm, other=0.0)
    return w0, w1, w2, w3, u0, u1, u2


@triton.jit
def _conv4_silu(x, w0, w1, w2, w3, u0, u1, u2, INTERP: tl.constexpr):
    """silu(sum_j w_j * window_j) in fp32 over the window [u0, u1, u2, x] in x's dtype, taps summed in order."""
    acc = w0 * cast(u0, x.dtype, INTERP).to(tl.float32)
    acc += w1 * cast(u1, x.dtype, INTERP).to(tl.float32)
    acc += w2 * cast(u2, x.dtype, INTERP).to(tl.float32)
    acc += w3 * x.to(tl.float32)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _conv4_store(x, u1, u2, cs_ptr, out_slot, c, cm, stride_cs, stride_cc, stride_ck, INTERP: tl.constexpr):
    """The rolled state [u1, u2, x] (cast to the state's dtype: copies when the dtypes agree) to ``out_slot``."""
    base = cs_ptr + out_slot * stride_cs + c * stride_cc
    dt = cs_ptr.dtype.element_ty
    tl.store(base, cast(cast(u1, x.dtype, INTERP), dt, INTERP), mask=cm)
    tl.store(base + stride_ck, cast(cast(u2, x.dtype, INTERP), dt, INTERP), mask=cm)
    tl.store(base + 2 * stride_ck, cast(x, dt, INTERP), mask=cm)


@triton.jit
def _qkv_windows(cw_ptr, cs_ptr, slot, cq, ck, cv, dkm, dvm, stride_wc, stride_wk, stride_cs, stride_cc, stride_ck):
    """The taps and old conv inputs (:func:`_conv4_load`) of a head program's q, k and v channels: 21 vectors."""
    qw0, qw1, qw2, qw3, qu0, qu1, qu2 = _conv4_load(cw_ptr, cs_ptr, slot, cq, dkm, stride_wc, stride_wk, stride_cs,
                                                    stride_cc, stride_ck)
    kw0, kw1, kw2, kw3, ku0, ku1, ku2 = _conv4_load(cw_ptr, cs_ptr, slot, ck, dkm, stride_wc, stride_wk, stride_cs,
                                                    stride_cc, stride_ck)
    vw0, vw1, vw2, vw3, vu0, vu1, vu2 = _conv4_load(cw_ptr, cs_ptr, slot, cv, dvm, stride_wc, stride_wk, stride_cs,
                                                    stride_cc, stride_ck)
    return (qw0, qw1, qw2, qw3, qu0, qu1, qu2, kw0, kw1, kw2, kw3, ku0, ku1, ku2,
            vw0, vw1, vw2, vw3, vu0, vu1, vu2)


@triton.jit
def _token_step(x_ptr, z_ptr, a_ptr, b_ptr, cs_ptr, o_ptr, row, out_slot, h, cq, ck, cv, dk, dv, dkm, dvm, writer_key,
                writer_value,
                qw0, qw1, qw2, qw3, qu0, qu1, qu2, kw0, kw1, kw2, kw3, ku0, ku1, ku2,
                vw0, vw1, vw2, vw3, vu0, vu1, vu2, s, s_out_ptrs, smask, na, dt, nw, scale, eps,
                stride_xb, stride_zb, stride_zh, stride_ab, stride_bb, stride_cs, stride_cc, stride_ck, stride_ob,
                stride_oh, R: tl.constexpr, DV: tl.constexpr, NW_DTYPE: tl.constexpr, INTERP: tl.constexpr,
                SIGMOID: tl.constexpr):
    """One token of one (row, value head) after the PDL wait, shared by ``_decode_kernel`` and ``gdn_verify``'s
    kernel: its x, z, a, b; the conv + SiLU over the window (rounded to x.dtype, as ``causal_conv1d_update`` returns
    it); the rolled window to ``out_slot`` (the q/k channels only in the program whose ``writer_key % R`` is
    ``writer_value``); the gates; the recurrence, whose new
    state goes to ``s_out_ptrs``; o rounded to x.dtype and the gated norm, stored to ``o`` row ``row``. Returns the
    new state and the token's q, k, v inputs (the next window's last entries)."""
    x_row = x_ptr + row * stride_xb
    x_q = tl.load(x_row + cq, mask=dkm, other=0.0)
    x_k = tl.load(x_row + ck, mask=dkm, other=0.0)
    x_v = tl.load(x_row + cv, mask=dvm, other=0.0)
    a = tl.load(a_ptr + row * stride_ab + h).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bb + h).to(tl.float32)
    # z too is the input projection's output, i.e. the previous launch's: after the wait, with x.
    z = tl.load(z_ptr + row * stride_zb + h * stride_zh + dv, mask=dvm, other=0.0).to(tl.float32)
    q = cast(_conv4_silu(x_q, qw0, qw1, qw2, qw3, qu0, qu1, qu2, INTERP), x_ptr.dtype.element_ty, INTERP)
    k = cast(_conv4_silu(x_k, kw0, kw1, kw2, kw3, ku0, ku1, ku2, INTERP), x_ptr.dtype.element_ty, INTERP)
    v = cast(_conv4_silu(x_v, vw0, vw1, vw2, vw3, vu0, vu1, vu2, INTERP), x_ptr.dtype.element_ty, INTERP)
    _conv4_store(x_v, vu1, vu2, cs_ptr, out_slot, cv, dvm, stride_cs, stride_cc, stride_ck, INTERP)
    writer = dkm & ((dk * 0 + writer_key) % R == writer_value)   # a vector mask: the interpreter's stores want one
    _conv4_store(x_q, qu1, qu2, cs_ptr, out_slot, cq, writer, stride_cs, stride_cc, stride_ck, INTERP)
    _conv4_store(x_k, ku1, ku2, cs_ptr, out_slot, ck, writer, stride_cs, stride_cc, stride_ck, INTERP)
    g, beta = gates_math(a, b, dt, na)
    s, o = recurrent_update(s, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), g, beta, scale)
    tl.store(s_out_ptrs, s, mask=smask)
    o16 = cast(o, o_ptr.dtype.element_ty, INTERP).to(tl.float32)
    out = gated_norm_rows(o16[None, :], z[None, :], nw, eps, DV, o_ptr.dtype.element_ty, NW_DTYPE, INTERP, SIGMOID)
    tl.store(o_ptr + row * stride_ob + h * stride_oh + dv[None, :], cast(out, o_ptr.dtype.element_ty, INTERP),
             mask=dvm[None, :])
    return s, x_q, x_k, x_v


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "out_slots_ptr"])
def _decode_kernel(x_ptr, z_ptr, a_ptr, b_ptr, cw_ptr, cs_ptr, st_ptr, slots_ptr, out_slots_ptr, na_ptr, dt_ptr,
                   nw_ptr, tk_ptr, o_ptr, scale, eps, HK, stride_xb, stride_zb, stride_zh, stride_ab, stride_bb,
                   stride_wc, stride_wk, stride_cs, stride_cc, stride_ck, stride_ob, stride_oh, ss_s, ss_h, ss_k,
                   R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, NW_DTYPE: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
                   SIGMOID: tl.constexpr):
    # Program (row, value head h): the whole decode tail of one head in one launch (conv width 4). The conv of the
    # head's v channels is its own; the conv of its key head's q and k channels is computed by each of the R
    # programs of that key head (the same values), and the rolled q/k conv state is written by the last of them
    # to have read the old one, elected by a per-(slot, key head) ticket taken before the PDL wait.
    row, h, hk, dk, dv, dkm, dvm = _head_lanes(R, DK, DV, BK, BV)
    cq = hk * DK + dk
    ck = KEY_DIM + cq
    cv = 2 * KEY_DIM + h * DV + dv
    # Before the wait: step inputs (slot ids), parameters, and state this layer's previous step wrote.
    slot = tl.load(slots_ptr + row)
    out_slot = tl.load(out_slots_ptr + row)
    s_ptrs = st_ptr + slot * ss_s + h * ss_h + dk[:, None] * ss_k + dv[None, :]
    smask = dkm[:, None] & dvm[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)
    nw = tl.load(nw_ptr + dv, mask=dvm, other=0.0).to(tl.float32)
    (qw0, qw1, qw2, qw3, qu0, qu1, qu2, kw0, kw1, kw2, kw3, ku0, ku1, ku2, vw0, vw1, vw2, vw3, vu0, vu1,
     vu2) = _qkv_windows(cw_ptr, cs_ptr, slot, cq, ck, cv, dkm, dvm, stride_wc, stride_wk, stride_cs, stride_cc,
                         stride_ck)
    na = tl.load(na_ptr + h)
    dt = tl.load(dt_ptr + h)
    # The ticket. Every thread's reads of the old q/k conv state are done (the barrier), then one increment: the R
    # programs of this (slot, key head) take consecutive counts, and the one holding R - 1 modulo R read last, so
    # it writes the rolled state. It subtracts R at its end: the count is a multiple of R between launches, with
    # no reset that could race the next launch's increments (atomics commute). No program waits on another.
    tl.debug_barrier()
    tk = tk_ptr + slot * HK + hk
    ticket = tl.atomic_add(tk, 1, sem="acq_rel", scope="gpu")
    pdl_wait(PDL)
    _token_step(x_ptr, z_ptr, a_ptr, b_ptr, cs_ptr, o_ptr, row, out_slot, h, cq, ck, cv, dk, dv, dkm, dvm, ticket, R - 1,
                qw0, qw1, qw2, qw3, qu0, qu1, qu2, kw0, kw1, kw2, kw3, ku0, ku1, ku2, vw0, vw1, vw2, vw3, vu0, vu1, vu2,
                s, s_ptrs + (out_slot - slot) * ss_s, smask, na, dt, nw, scale, eps, stride_xb, stride_zb, stride_zh,
                stride_ab, stride_bb, stride_cs, stride_cc, stride_ck, stride_ob, stride_oh, R, DV, NW_DTYPE, INTERP,
                SIGMOID)
    if ticket % R == R - 1:
        tl.atomic_add(tk, -R, sem="relaxed", scope="gpu")


def _tickets(conv_states: torch.Tensor, key_heads: int, value_heads: int) -> tuple[torch.Tensor | None, bool]:
    """``(counters, made_now)``: the zeroed int32 ticket counters [slots, key heads] of ``_decode_kernel`` for this
    conv-state pool size and head layout, made once per device and shared by every GDN layer (each launch leaves
    them at multiples of R; the layers' launches are stream-ordered). ``made_now``: the zero fill was just launched,
    so the kernel, which takes its ticket before its PDL wait, must start plainly. ``(None, False)`` when they would
    have to be made inside a CUDA graph capture: the caller takes the two-launch path (and warns, since those
    graphs then differ from eager calls in the conv's last bits). The decode graphs' eager warm-up makes them."""
    key = (str(conv_states.device), conv_states.shape[0], key_heads, value_heads)
    t = _TICKETS.get(key)
    if t is not None:
        return t, False
    if conv_states.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _log.warning("gdn_decode: first call inside a CUDA graph capture; the graph takes the two-launch path "
                     "(run it once eagerly before capturing to get the one-launch kernel)")
        return None, False
    t = _TICKETS[key] = torch.zeros((conv_states.shape[0], key_heads), dtype=torch.int32, device=conv_states.device)
    return t, True


_TICKETS: dict = {}
_log = logging.getLogger(__name__)


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_heads(op: str, channels: int, p: GDNDecodeParams) -> None:
    """ValueError unless the value heads are a multiple of the key heads and ``channels`` (the mixed input's and the
    conv weight's) are q | k | v's."""
    hv, dv, hk, dk = p.value_heads, p.value_dim, p.key_heads, p.key_dim
    if hv % hk:
        raise ValueError(f"GDN: value heads {hv} are not a multiple of key heads {hk}")
    if channels != 2 * hk * dk + hv * dv or p.conv_weight.shape[0] != channels:
        raise ValueError(f"{op}: {channels} mixed channels, conv weight {tuple(p.conv_weight.shape)}, "
                         f"heads {hk}x{dk} + {hv}x{dv}")


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: GDNDecodeParams,
               conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
               out_slots: torch.Tensor | None = None, *, step_warps: int = 4, one_kernel: bool = True) -> torch.Tensor:
    """``o[B, Hv, Dv]``: gates, conv, recurrent step and gated norm of B decode rows (contract ``gdn_decode``).
    ``step_warps``: the (step) kernel's warps (a launch-shape override for sweeps; the default 4 is the fastest
    tools/gpu_decode_fusion_sweep.py finds, at one row and at eight).
    ``one_kernel=False`` takes the two-launch path even at conv width 4 (for comparisons)."""
    launch_ok(mixed)
    p = params
    bsz, channels = mixed.shape
    hv, dv, hk, dk = p.value_heads, p.value_dim, p.key_heads, p.key_dim
    _check_heads("gdn_decode", channels, p)
    if slots.shape != (bsz,) or (out_slots is not None and out_slots.shape != (bsz,)):
        raise ValueError(f"gdn_decode: {bsz} rows need {bsz} slots (and out slots), got {tuple(slots.shape)}")
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        raise ValueError("gdn_decode: states must be fp32 with a contiguous last dim")
    o = torch.empty((bsz, hv, dv), dtype=mixed.dtype, device=mixed.device)
    if bsz == 0:
        return o
    mixed, z, a, b = _last_contig(mixed), _last_contig(z), _last_contig(a), _last_contig(b)
    slot_ids = slots.to(device=mixed.device, dtype=torch.int64)
    out_ids = slot_ids if out_slots is None else out_slots.to(device=mixed.device, dtype=torch.int64)
    # The kernels read the slot ids before their PDL wait: if converting them just launched a kernel, the conv
    # kernel starts plainly (the step kernel's previous launch is then the conv kernel, which writes no ids).
    converted = slot_ids is not slots or (out_slots is not None and out_ids is not out_slots)
    slots, out_slots = slot_ids, out_ids
    neg_a, dt_bias = p.neg_a.float().contiguous(), p.dt_bias.float().contiguous()
    k = p.conv_weight.shape[-1]
    nw_dtype = TL_DTYPE[torch.promote_types(mixed.dtype, p.norm_weight.dtype)]
    nw = p.norm_weight.contiguous()
    tickets, fresh = _tickets(conv_states, hk, hv) if one_kernel and k == 4 else (None, False)
    if tickets is not None:
        # The kernel reads the parameters and takes its ticket before its PDL wait: a conversion or the tickets'
        # zero fill just launched (the gate constants are fp32 by contract, the weights contiguous in the model)
        # would be the previous launch, so it then starts plainly.
        converted = (converted or fresh or neg_a is not p.neg_a or dt_bias is not p.dt_bias
                     or nw is not p.norm_weight)
        _decode_kernel[(bsz, hv)](
            mixed, z, a, b, p.conv_weight, conv_states, states, slots, out_slots, neg_a, dt_bias, nw, tickets, o,
            float(p.scale), float(p.eps), hk, mixed.stride(0), z.stride(0), z.stride(1), a.stride(0), b.stride(0),
            *p.conv_weight.stride(), *conv_states.stride(), o.stride(0), o.stride(1), *states.stride()[:3],
            R=hv // hk, DK=dk, DV=dv, KEY_DIM=hk * dk, BK=next_pow2(dk),
            BV=next_pow2(dv), NW_DTYPE=nw_dtype, INTERP=INTERPRET, SIGMOID=p.sigmoid_gate,
            **({} if INTERPRET else {"num_warps": step_warps}), **({"PDL": False} if converted else pdl(mixed)))
        return o
    y = torch.empty((bsz, channels), dtype=mixed.dtype, device=mixed.device)
    g = torch.empty((bsz, hv), dtype=torch.float32, device=mixed.device)
    beta = torch.empty((bsz, hv), dtype=torch.float32, device=mixed.device)
    block_c = min(_BLOCK_C, next_pow2(channels))
    _conv_gates_kernel[(bsz, triton.cdiv(channels, block_c))](
        mixed, p.conv_weight, conv_states, slots, out_slots, y, a, b, neg_a, dt_bias, g, beta, channels, hv,
        mixed.stride(0), *p.conv_weight.stride(), *conv_states.stride(), y.stride(0), a.stride(0), b.stride(0),
        K=k, BLOCK_C=block_c, BLOCK_K=next_pow2(k), BH=next_pow2(hv), INTERP=INTERPRET,
        **({} if INTERPRET else {"num_warps": 4}), **({"PDL": False} if converted else pdl(mixed)))
    _step_norm_kernel[(bsz, hv)](
        y, z, g, beta, states, slots, out_slots, nw, o, float(p.scale), float(p.eps), hv,
        y.stride(0), z.stride(0), z.stride(1), o.stride(0), o.stride(1), *states.stride()[:3],
        R=hv // hk, DK=dk, DV=dv, KEY_DIM=hk * dk, BK=next_pow2(dk), BV=next_pow2(dv), NW_DTYPE=nw_dtype,
        INTERP=INTERPRET, SIGMOID=p.sigmoid_gate, **({} if INTERPRET else {"num_warps": step_warps}), **pdl(mixed))
    return o


OPS = [OpImpl(op="gdn_decode", name="triton", fn=gdn_decode, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
              priority=10)]
