"""Decode-sized ``moe_experts`` on quantized expert banks: two GEMV kernels reading packed codes and scales
straight from the routing ids (the quantized counterpart of :mod:`ninfer.ops.triton.moe_gemv`).

1. ``_gate_up_kernel``, grid (T*k, I / BN): for pair p = t*k + j, e = ids[t, j], the BN gate rows and the BN up
   rows of expert e, interleaved into one ``[2*BN]`` row tile so one pass over x and one chunk loop read both;
   act[p] = silu(gate_e x_t) * up_e x_t, kept in fp32 (the reference decodes the bank to fp32, so its GEMMs and
   activation run in fp32).
2. ``_down_kernel``, grid (T, H / BN): out[t] = round(sum_j w[t, j] * down_e act[p] + sigmoid(gate_logit[t]) *
   down_s round(silu(g) * u)), the shared expert (packed or dense) from the caller's [g | u] projection, its
   activation rounded to x.dtype as the reference does; one fp32 sum in a fixed order, rounded once.

Weights are read through :func:`ninfer.ops.triton._quant_tiles.rows_dot`: each program reads its rows' stored
bytes (codes, high bits, scales) once, never a decoded copy; with one token each selected expert's rows are read
once per step. Two tokens sharing an expert read it twice (the second mostly from L2), as in the bf16 GEMV path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.contracts import SharedExpert
from ninfer.ops.triton._common import INTERPRET, TL_DTYPE, cast, pdl, pdl_wait
from ninfer.ops.triton._quant_tiles import Operand, rows_dot
from ninfer.ops.triton.moe_gemv import _block_n, _sm_count

# Elements of a [R, NG, 32] code tile per chunk (4 warps: 32 per thread), and the lanes one chunk aims to cover.
_TILE = 4096
_CHUNK_LANES = 512


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, act_ptr, w0, w1, w2, s0, s1, s2, H, NI, SLOTS, sx_t,
                    FMT: tl.constexpr, TOPK: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                    NCH: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    p = tl.program_id(0)
    t = p // TOPK
    e = tl.load(ids_ptr + p)
    r = tl.arange(0, 2 * BN)
    n_in = tl.minimum(tl.program_id(1) * BN + r // 2, NI - 1)   # rows past I re-read row I-1; the store is masked
    rows = e * (2 * NI) + (r % 2) * NI + n_in                       # [gate n, up n, gate n+1, up n+1, ...]
    y = rows_dot(w0, w1, w2, s0, s1, s2, rows, x_ptr + t * sx_t, 0, H, SLOTS,
                 FMT, 2 * BN, NG, NCH, False, tl.float32, INTERP)
    gate, up = tl.split(tl.reshape(y, (BN, 2)))
    act = gate / (1.0 + tl.exp(-gate)) * up
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    tl.store(act_ptr + p * NI + n, act, mask=n < NI)


@triton.jit
def _down_kernel(act_ptr, ids_ptr, rw_ptr, out_ptr, w0, w1, w2, s0, s1, s2, NI, H, SLOTS, so_t,
                 sp_ptr, sg_ptr, q0, q1, q2, t0, t1, t2, NIS, SSLOTS, sp_t, sg_t,
                 FMT: tl.constexpr, SFMT: tl.constexpr, TOPK: tl.constexpr, BN: tl.constexpr,
                 NG: tl.constexpr, NCH: tl.constexpr, SNG: tl.constexpr, SNCH: tl.constexpr,
                 HAS_SHARED: tl.constexpr, ODT: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_in = tl.minimum(n, H - 1).to(tl.int64)
    total = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p)
        part = rows_dot(w0, w1, w2, s0, s1, s2, e * H + n_in, act_ptr + p * NI, 0, NI, SLOTS,
                        FMT, BN, NG, NCH, False, tl.float32, INTERP)
        total += tl.load(rw_ptr + p) * part
    if HAS_SHARED:
        part = rows_dot(q0, q1, q2, t0, t1, t2, n_in, sp_ptr + t * sp_t, NIS, NIS, SSLOTS,
                        SFMT, BN, SNG, SNCH, True, ODT, INTERP)
        gl = tl.load(sg_ptr + t * sg_t).to(tl.float32)
        total += part / (1.0 + tl.exp(-gl))
    tl.store(out_ptr + t * so_t + n, cast(total, ODT, INTERP), mask=n < H)


def _chunks(op: Operand) -> tuple[int, int]:
    """(NG slots per chunk, NCH chunks) covering ``op``'s rows: about _CHUNK_LANES lanes a chunk."""
    ng = min(_CHUNK_LANES // op.slot_lanes, triton.next_power_of_2(op.slots))
    return ng, triton.cdiv(op.slots, ng)


def _rows_per_program(programs: int, width: int, rows_per_n: int, tile_row: int, sms: int) -> int:
    """BN: as the bf16 GEMV's choice, halved while a chunk's code tile (``tile_row`` elements a row) exceeds _TILE."""
    bn = _block_n(programs, width, sms)
    while bn > 1 and rows_per_n * bn * tile_row > _TILE:
        bn //= 2
    return bn


def moe_experts_gemv(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gu: Operand, dn: Operand,
                     shared: SharedExpert | None, sh: Operand | None) -> torch.Tensor:
    """The decode path of :func:`ninfer.ops.triton.quant_moe.moe_experts` (inputs already checked: x [T, H]
    with a contiguous last dim, operands of matching shapes, the shared projection's last dim contiguous)."""
    t_len, hidden = x.shape
    top_k = ids.shape[1]
    inter = dn.k
    out = torch.empty((t_len, hidden), dtype=x.dtype, device=x.device)
    if t_len == 0:
        return out
    ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
    rw = weights.float().contiguous()
    sms = _sm_count(x.device)
    kw = {} if INTERPRET else {"num_warps": 4}
    act = torch.empty((t_len * top_k, inter), dtype=torch.float32, device=x.device)
    ng1, nch1 = _chunks(gu)
    bn1 = _rows_per_program(t_len * top_k, inter, 2, ng1 * gu.slot_bytes, sms)
    _gate_up_kernel[(t_len * top_k, triton.cdiv(inter, bn1))](
        x, ids, act, *gu.args(), hidden, inter, gu.slots, x.stride(0),
        FMT=gu.fmt, TOPK=top_k, BN=bn1, NG=ng1, NCH=nch1, INTERP=INTERPRET, **kw, **pdl(x))
    ng2, nch2 = _chunks(dn)
    if shared is not None:
        proj, glog = shared.projected, shared.gate_logit
        sng, snch = _chunks(sh)
        s_row = sng * sh.slot_bytes
        sargs = (*sh.args(), sh.k, sh.slots, proj.stride(0), glog.stride(0))
        sfmt = sh.fmt
    else:  # unused arguments (HAS_SHARED=False compiles the branch away)
        proj = glog = x
        sng, snch, sfmt, s_row = 1, 1, 0, 0
        sargs = (x, x, x, 0, 0, 0, 0, 0, 0, 0)
    bn2 = _rows_per_program(t_len, hidden, 1, max(ng2 * dn.slot_bytes, s_row), sms)
    _down_kernel[(t_len, triton.cdiv(hidden, bn2))](
        act, ids, rw, out, *dn.args(), inter, hidden, dn.slots, out.stride(0), proj, glog, *sargs,
        FMT=dn.fmt, SFMT=sfmt, TOPK=top_k, BN=bn2, NG=ng2, NCH=nch2, SNG=sng, SNCH=snch,
        HAS_SHARED=shared is not None, ODT=TL_DTYPE[x.dtype], INTERP=INTERPRET, **kw, **pdl(x))
    return out
