"""Triton ``gdn_decode``: a Gated DeltaNet layer's decode step after its input projection, in two kernels.

The composition it replaces (``gdn_gates`` -> ``causal_conv1d_update`` -> ``gdn_recurrent_step`` ->
``gated_rms_norm``) is four launches of 1-4 us each per GDN layer per step, nearly all of it launch and
dependency latency: the whole step moves ~4 MB (the recurrent state, read and written) at the 35B-A3B shape.

1. ``_conv_gates_kernel`` -- program (row, block of channels): the causal conv + SiLU of its channels (the
   taps and old conv state are loaded before the PDL wait), and, in the programs of channel block 0, the
   row's gates. Writes the conv output y (x.dtype, as ``causal_conv1d_update`` rounds it) and fp32 g, beta.
2. ``_step_norm_kernel`` -- program (row, value head): loads its whole [Dk, Dv] state, its z and the norm
   weight *before* the PDL wait (the state was last written by this layer's previous step, z by the input
   projection two launches back), so the 64 KB state stream overlaps kernel 1; then q, k, v, g, beta,
   the recurrence (:func:`~ninfer.ops.triton.gdn.recurrent_update`), o rounded to x.dtype as the step op
   rounds it, and the gated RMSNorm over the head (:func:`~ninfer.ops.triton.norm.gated_norm_rows`).
   A program owns a whole head because the norm is over Dv.

Why not one kernel: the q/k conv channels of a key head feed every value head (and every Dv tile) that reads
it, and the conv state is updated in place; a single kernel would need a grid-wide barrier between the last
read of the old conv state and its overwrite. Two launches give that order for free.

Invariants: those of the four ops it composes (contract ``gdn_decode``); rows are independent; only the rows'
own slots are read and their out slots written. The result equals the composition of the four Triton ops up to
the reduction order of the norm (bitwise equal in the tests' cases is not promised).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.contracts import GDNDecodeParams
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2, pdl, pdl_wait
from ninfer.ops.triton.conv1d import conv_update_finish, conv_update_prologue
from ninfer.ops.triton.gdn import recurrent_update
from ninfer.ops.triton.gdn_gates import gates_row
from ninfer.ops.triton.norm import _TL_DTYPE, gated_norm_rows

# Channels per conv program (the conv reads ~C * K * 2 bytes of taps; 8192 channels at 256 = 32 programs/row).
_BLOCK_C = 256


@triton.jit
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
def _step_norm_kernel(y_ptr, z_ptr, g_ptr, beta_ptr, st_ptr, slots_ptr, out_slots_ptr, nw_ptr, o_ptr, scale, eps,
                      H, stride_yb, stride_zb, stride_zh, stride_ob, stride_oh, ss_s, ss_h, ss_k,
                      R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, NW_DTYPE: tl.constexpr, INTERP: tl.constexpr,
                      PDL: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // R
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    dkm = dk < DK
    dvm = dv < DV
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
    out = gated_norm_rows(o16[None, :], z[None, :], nw, eps, DV, o_ptr.dtype.element_ty, NW_DTYPE, INTERP)
    tl.store(o_ptr + row * stride_ob + h * stride_oh + dv[None, :], cast(out, o_ptr.dtype.element_ty, INTERP),
             mask=dvm[None, :])


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: GDNDecodeParams,
               conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
               out_slots: torch.Tensor | None = None, *, step_warps: int = 4) -> torch.Tensor:
    """``o[B, Hv, Dv]``: gates, conv, recurrent step and gated norm of B decode rows (contract ``gdn_decode``).
    ``step_warps``: the step kernel's warps (a launch-shape override for sweeps; 4 measured fastest on an H200,
    tools/gpu_decode_fusion_sweep.py: B=1 6.2 us vs 7.3 at 8 warps, B=8 14.5 vs 19.1)."""
    launch_ok(mixed)
    p = params
    bsz, channels = mixed.shape
    hv, dv, hk, dk = p.value_heads, p.value_dim, p.key_heads, p.key_dim
    if hv % hk:
        raise ValueError(f"GDN: value heads {hv} are not a multiple of key heads {hk}")
    if channels != 2 * hk * dk + hv * dv or p.conv_weight.shape[0] != channels:
        raise ValueError(f"gdn_decode: {channels} mixed channels, conv weight {tuple(p.conv_weight.shape)}, "
                         f"heads {hk}x{dk} + {hv}x{dv}")
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
    y = torch.empty((bsz, channels), dtype=mixed.dtype, device=mixed.device)
    g = torch.empty((bsz, hv), dtype=torch.float32, device=mixed.device)
    beta = torch.empty((bsz, hv), dtype=torch.float32, device=mixed.device)
    block_c = min(_BLOCK_C, next_pow2(channels))
    _conv_gates_kernel[(bsz, triton.cdiv(channels, block_c))](
        mixed, p.conv_weight, conv_states, slots, out_slots, y, a, b, neg_a, dt_bias, g, beta, channels, hv,
        mixed.stride(0), *p.conv_weight.stride(), *conv_states.stride(), y.stride(0), a.stride(0), b.stride(0),
        K=k, BLOCK_C=block_c, BLOCK_K=next_pow2(k), BH=next_pow2(hv), INTERP=INTERPRET,
        **({} if INTERPRET else {"num_warps": 4}), **({"PDL": False} if converted else pdl(mixed)))
    nw_dtype = _TL_DTYPE[torch.promote_types(mixed.dtype, p.norm_weight.dtype)]
    _step_norm_kernel[(bsz, hv)](
        y, z, g, beta, states, slots, out_slots, p.norm_weight.contiguous(), o, float(p.scale), float(p.eps), hv,
        y.stride(0), z.stride(0), z.stride(1), o.stride(0), o.stride(1), *states.stride()[:3],
        R=hv // hk, DK=dk, DV=dv, KEY_DIM=hk * dk, BK=next_pow2(dk), BV=next_pow2(dv), NW_DTYPE=nw_dtype,
        INTERP=INTERPRET, **({} if INTERPRET else {"num_warps": step_warps}), **pdl(mixed))
    return o


OPS = [OpImpl(op="gdn_decode", name="triton", fn=gdn_decode, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
              priority=10)]
