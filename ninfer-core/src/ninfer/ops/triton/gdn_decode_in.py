"""Triton ``gdn_decode_in``: a GDN layer's decode input stage -- pre-norm, fused input projection, gates and conv
update -- as one GEMV for one row.

At decode the input projection is a weight stream ([qkv | z | b | a] rows of the ``gdn/in_proj`` parent, 50 MB at
the 35B-A3B shape), and everything after it up to the recurrent step is elementwise per output row: the causal
conv + SiLU of channel c needs only projection row c, its K taps and its K-1 old inputs; the gates of head h only
rows b_h and a_h. So the GEMV program that computes a row finishes it: conv (state rolled in place), z as is,
beta = sigmoid(b), g = neg_a * softplus(a + dt_bias). The separate conv + gates kernel of ``gdn_decode`` (a launch,
a PDL wait and its loads on the critical path of every GDN layer) is gone; ``gdn_decode_step`` follows.

Invariants:
- Program p owns parent rows [p*BN, (p+1)*BN): it alone reads and writes their conv state, and its loads of the
  old state precede its store of the new one by data dependence, so the in-place update is race-free (as in
  :mod:`ninfer.ops.triton.conv1d`).
- Before the PDL wait a program reads only weights (its weight tile, the norm weight, conv taps, neg_a, dt_bias),
  its rows' old conv state (written by this layer's previous step, launches ago) and the slot ids (step inputs,
  or a conversion launched plainly before: then this kernel starts without PDL).
- Values are the contract's composition bit for bit: the pre-norm and projection as ``add_rms_norm_linear``'s
  kernel forms them (:func:`~ninfer.ops.triton.linear.norm_row`, each dot rounded to x.dtype), the conv with
  :func:`~ninfer.ops.triton.conv1d.conv_update_finish`, the gates with
  :func:`~ninfer.ops.triton.gdn_gates.gates_math`.

Taken for one row where ``add_rms_norm_linear``'s fused GEMV applies (the row fits one tile); otherwise the same
composition in two launches: ``add_rms_norm_linear`` then ``gdn_decode``'s conv + gates kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.contracts import GDNDecodeParams
from ninfer.ops.reference.gdn import gdn_in_sizes
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton import gdn_decode as _decode
from ninfer.ops.triton import linear as _linear
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2, pdl, pdl_wait
from ninfer.ops.triton.conv1d import conv_update_finish, conv_update_prologue
from ninfer.ops.triton.gdn_gates import gates_math

# Parent rows per program: add_rms_norm_linear's one-row shape (every program re-forms the row's norm).
_BN = _linear._NORM_BN


@triton.jit
def _gdn_in_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, ro_ptr, y_ptr, z_ptr, g_ptr, beta_ptr, cw_ptr, cs_ptr, slots_ptr,
                   out_slots_ptr, na_ptr, dt_ptr, eps, K, C, VD, HV, sw_n, stride_wc, stride_wk, stride_ss,
                   stride_sc, stride_sk, BN: tl.constexpr, BK: tl.constexpr, CK: tl.constexpr,
                   BLOCK_CK: tl.constexpr, EXACT: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    nm = n < C + VD + 2 * HV
    n_in = tl.where(nm, n, 0)
    kk = tl.arange(0, BK)
    # Before the wait (module docstring): the weight tile, the norm weight, the conv rows' taps and old state, and
    # the gate constants.
    w_ptrs = w_ptr + n_in[:, None] * sw_n + kk[None, :]
    if EXACT:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=kk[None, :] < K, other=0.0)
    nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    is_conv = nm & (n < C)
    c = tl.where(is_conv, n, 0)
    slot = tl.load(slots_ptr).to(tl.int64)
    old, taps = conv_update_prologue(cw_ptr, cs_ptr, slot, c, is_conv, stride_wc, stride_wk, stride_ss, stride_sc,
                                     stride_sk, CK, BLOCK_CK)
    hb = n - (C + VD)                  # head of a b row, then (hb - HV) of an a row
    is_b = nm & (hb >= 0) & (hb < HV)
    is_a = nm & (hb >= HV)
    ha = tl.where(is_a, hb - HV, 0)
    dt = tl.load(dt_ptr + ha, mask=is_a, other=0.0)
    na = tl.load(na_ptr + ha, mask=is_a, other=0.0)
    pdl_wait(PDL)
    xm = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    rm = tl.load(r_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    res, hm = _linear.norm_row(xm, rm, nw, K, eps, ro_ptr.dtype.element_ty, x_ptr.dtype.element_ty, INTERP)
    tl.store(ro_ptr + kk, res, mask=(kk < K) & (kk * 0 + pid == 0))
    acc = tl.sum(w.to(tl.float32) * hm.to(tl.float32)[None, :], 1)
    v = cast(acc, x_ptr.dtype.element_ty, INTERP)     # the projection, rounded as linear rounds it
    out_slot = tl.load(out_slots_ptr).to(tl.int64)
    yv = conv_update_finish(v, old, taps, cs_ptr, out_slot, c, is_conv, stride_ss, stride_sc, stride_sk, CK,
                            BLOCK_CK, INTERP)
    tl.store(y_ptr + c, cast(yv, y_ptr.dtype.element_ty, INTERP), mask=is_conv)
    is_z = nm & (n >= C) & (n < C + VD)
    tl.store(z_ptr + tl.where(is_z, n - C, 0), v, mask=is_z)
    vf = v.to(tl.float32)
    g, beta = gates_math(vf, vf, dt, na)
    tl.store(beta_ptr + tl.where(is_b, hb, 0), beta, mask=is_b)
    tl.store(g_ptr + ha, g, mask=is_a)


def _fused_ok(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.shape[0] == 1 and _linear.use_gemv(x, weight) and x.shape[1] <= _linear._TILE
            and residual.dtype == x.dtype and residual.stride(-1) == 1 and x.stride(-1) == 1)


def gdn_decode_in(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, params: GDNDecodeParams, conv_states: torch.Tensor, slots: torch.Tensor,
                  out_slots: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, z, g, beta, new_residual)`` of B decode rows (contract ``gdn_decode_in``): one kernel for one row,
    else ``add_rms_norm_linear`` then the conv + gates kernel."""
    launch_ok(x)
    p = params
    c, vd, hv = gdn_in_sizes(p)
    bsz, hidden = x.shape
    if residual.shape != x.shape or norm_weight.shape != (hidden,) or weight.shape != (c + vd + 2 * hv, hidden):
        raise ValueError(f"gdn_decode_in: x {tuple(x.shape)}, residual {tuple(residual.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}, weight {tuple(weight.shape)}: the layer needs weight "
                         f"[{c + vd + 2 * hv}, {hidden}] ([qkv {c} | z {vd} | b {hv} | a {hv}])")
    _decode._check_params(p, c)
    slots, out_slots, converted = _decode.slot_ids(slots, out_slots, bsz, x.device, "gdn_decode_in")
    if not _fused_ok(x, residual, weight):
        proj, _, new_residual = _linear.add_rms_norm_linear(x, residual, norm_weight, eps, weight)
        mixed, z, b, a = proj.split([c, vd, hv, hv], dim=-1)
        if bsz == 0:
            empty = torch.empty((0, hv), dtype=torch.float32, device=x.device)
            return mixed, z.reshape(0, hv, p.value_dim), empty, empty, new_residual
        # The conv kernel's previous launch is the projection, which writes no slot ids: plain only if converted.
        y, g, beta = _decode.conv_gates(mixed, a, b, p, conv_states, slots, out_slots, converted)
        return y, z.reshape(bsz, hv, p.value_dim), g, beta, new_residual
    y = torch.empty((1, c), dtype=x.dtype, device=x.device)
    z = torch.empty((1, vd), dtype=x.dtype, device=x.device)
    g = torch.empty((1, hv), dtype=torch.float32, device=x.device)
    beta = torch.empty((1, hv), dtype=torch.float32, device=x.device)
    new_residual = torch.empty_like(x)
    k = p.conv_weight.shape[-1]
    bk = min(next_pow2(hidden), _linear._TILE)
    _gdn_in_kernel[(triton.cdiv(c + vd + 2 * hv, _BN),)](
        x, residual, norm_weight.contiguous(), weight, new_residual, y, z, g, beta, p.conv_weight, conv_states,
        slots, out_slots, p.neg_a.float().contiguous(), p.dt_bias.float().contiguous(), float(eps), hidden, c, vd,
        hv, weight.stride(0), *p.conv_weight.stride(), *conv_states.stride(), BN=_BN, BK=bk, CK=k,
        BLOCK_CK=next_pow2(k), EXACT=hidden == bk, INTERP=INTERPRET, **({} if INTERPRET else {"num_warps": 4}),
        **({"PDL": False} if converted else pdl(x)))
    return y, z.view(1, hv, p.value_dim), g, beta, new_residual


OPS = [OpImpl(op="gdn_decode_in", name="triton", fn=gdn_decode_in, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
