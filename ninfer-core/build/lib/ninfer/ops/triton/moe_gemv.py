"""Decode-sized ``moe_experts``: two GEMV kernels straight from the routing ids, no alignment pass.

For a handful of tokens (T * k <= :data:`MAX_PAIRS`) the grouped path of :mod:`ninfer.ops.triton.moe` is
launch-bound: sorting the pairs by expert, padding to row blocks and the final sum are ~12 small kernels per
MoE layer, each a launch gap inside a decode CUDA graph, around a weight stream (~50 MB of experts) that takes
about as long as a few launches.
Here each (token, choice) pair reads its expert's rows directly:

1. ``_gate_up_gemv_kernel``, grid (T*k, I / BN): act[p] = round(silu(gate_e x_t) * up_e x_t) for pair
   p = t*k + j, e = ids[t, j] (the activation rounded to x.dtype, as the model and the reference do).
2. ``_down_gemv_one_shot_kernel`` (expert widths up to 1024; ``_down_gemv_kernel``, which loops over the
   experts, above), grid (T, H / BN): out[t] = round(sum_j w[t, j] * down_e act[p] (+ the shared expert:
   sigmoid(gate_logit[t]) * down_s round(silu(g) * u) from the caller's [g | u] projection)), every product and
   sum in fp32 in a fixed order: deterministic, and equal to the reference up to fp32 summation order. The
   one-shot kernel requests every expert's rows before its PDL wait (the routing is two launches back).

Weights stream as [BN, BK] tiles (K contiguous) into a [BN, BK] fp32 accumulator reduced once at the end (the
usual GEMV shape: no tensor cores at one row). A token routed twice to one expert is impossible (top-k ids are
distinct); two tokens sharing an expert read it twice, mostly from L2 -- above MAX_PAIRS the grouped path, which
reads each expert once, wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.contracts import SharedExpert
from ninfer.ops.triton._common import pdl, pdl_wait

# Pair count up to which moe_experts takes this path (T <= 16 at k = 8: every decode batch of the engine).
MAX_PAIRS = 128
# K tile of the gate/up GEMV: [BN, 512] weight tiles (8 KB each at BN = 8) keep enough bytes in flight per SM;
# 128-wide tiles keep too few bytes in flight to saturate HBM (tools/gpu_moe_gemv_sweep.py).
_BK_GATE_UP = 512
# Largest down-projection row held as one tile (the expert width I; fine-grained MoE models use 512-1024).
_BK_DOWN_MAX = 1024
# Elements of one [BN, BK] fp32 accumulator tile (4 warps: 32 registers per thread).
_TILE = 4096
# Weight elements of the one-shot down kernel's [KP, BN, I] tile (8 warps: 64 per thread).
_ONE_SHOT_TILE = 16384


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, H, NI, sx_t, sw_e, sw_n,
                         TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    p = tl.program_id(0)
    t = p // TOPK
    e = tl.load(ids_ptr + p)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < NI
    n_in = tl.where(nm, n, 0)      # in-bounds rows for unmasked weight loads; only the store is masked
    kk = tl.arange(0, BK)
    g_ptrs = w_ptr + e * sw_e + n_in[:, None] * sw_n + kk[None, :]
    u_ptrs = g_ptrs + NI * sw_n
    x_ptrs = x_ptr + t * sx_t + kk
    acc_g = tl.zeros((BN, BK), dtype=tl.float32)
    acc_u = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, H, BK):
        if EVEN:
            xv = tl.load(x_ptrs).to(tl.float32)
            wg = tl.load(g_ptrs).to(tl.float32)
            wu = tl.load(u_ptrs).to(tl.float32)
        else:
            km = (k0 + kk) < H
            xv = tl.load(x_ptrs, mask=km, other=0.0).to(tl.float32)
            wg = tl.load(g_ptrs, mask=km[None, :], other=0.0).to(tl.float32)
            wu = tl.load(u_ptrs, mask=km[None, :], other=0.0).to(tl.float32)
        acc_g += wg * xv[None, :]
        acc_u += wu * xv[None, :]
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + p * NI + n, act.to(act_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _down_gemv_kernel(act_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr, sp_ptr, sd_ptr, sg_ptr,
                      H, NI, NIS, sw_e, sw_n, so_t, sp_t, sd_n, sg_t,
                      TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_TILE: tl.constexpr,
                      HAS_SHARED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    # The k experts are unrolled and, when a row of the down matrix fits one tile (ONE_TILE: NI <= BK), each is a
    # single load: the k independent loads are all in flight at once, which is what a bandwidth-bound GEMV with
    # one token needs (a K loop per expert serialises them).
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    n_in = tl.where(nm, n, 0)
    kk = tl.arange(0, BK)
    total = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p)
        w_ptrs = w_ptr + e * sw_e + n_in[:, None] * sw_n + kk[None, :]
        a_ptrs = act_ptr + p * NI + kk
        if ONE_TILE:
            km = kk < NI
            a = tl.load(a_ptrs, mask=km, other=0.0).to(tl.float32)
            wd = tl.load(w_ptrs, mask=km[None, :], other=0.0).to(tl.float32)
            part = tl.sum(wd * a[None, :], 1)
        else:
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            for k0 in range(0, NI, BK):
                km = (k0 + kk) < NI
                a = tl.load(a_ptrs, mask=km, other=0.0).to(tl.float32)
                wd = tl.load(w_ptrs, mask=km[None, :], other=0.0).to(tl.float32)
                acc += wd * a[None, :]
                a_ptrs += BK
                w_ptrs += BK
            part = tl.sum(acc, 1)
        total += tl.load(rw_ptr + p) * part
    if HAS_SHARED:
        s_ptrs = sd_ptr + n_in[:, None] * sd_n + kk[None, :]
        g_ptrs = sp_ptr + t * sp_t + kk
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, NIS, BK):
            km = (k0 + kk) < NIS
            g = tl.load(g_ptrs, mask=km, other=0.0).to(tl.float32)
            u = tl.load(g_ptrs + NIS, mask=km, other=0.0).to(tl.float32)
            wd = tl.load(s_ptrs, mask=km[None, :], other=0.0).to(tl.float32)
            # Rounded to the activation dtype before the down projection, like the routed activations.
            a = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty).to(tl.float32)
            acc += wd * a[None, :]
            g_ptrs += BK
            s_ptrs += BK
        gl = tl.load(sg_ptr + t * sg_t).to(tl.float32)
        total += tl.sum(acc, 1) / (1.0 + tl.exp(-gl))
    tl.store(out_ptr + t * so_t + n, total.to(out_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _down_gemv_one_shot_kernel(act_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr, sp_ptr, sd_ptr, sg_ptr,
                               H, NI, NIS, sw_e, sw_n, so_t, sp_t, sd_n, sg_t,
                               TOPK: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                               BKS: tl.constexpr, HAS_SHARED: tl.constexpr, PDL: tl.constexpr):
    # Every load of the program is issued before any arithmetic: the k experts' [BN, I] rows as one [KP, BN, BK]
    # tile (ids gathered as a vector), their activations, and the shared expert's rows and projection. A loop
    # over the experts with a reduction per expert (``_down_gemv_kernel``) waits for each expert's load in turn:
    # the reduction's barrier keeps the next load from issuing. Requires NI <= BK and NIS <= BKS.
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    n_in = tl.where(nm, n, 0)
    j = tl.arange(0, KP)
    jm = j < TOPK
    p = t * TOPK + tl.where(jm, j, 0)
    e = tl.load(ids_ptr + p)
    rw = tl.where(jm, tl.load(rw_ptr + p), 0.0)
    kk = tl.arange(0, BK)
    km = kk < NI
    w = tl.load(w_ptr + e[:, None, None] * sw_e + n_in[None, :, None] * sw_n + kk[None, None, :],
                mask=km[None, None, :], other=0.0)
    if HAS_SHARED:
        ks = tl.arange(0, BKS)
        ksm = ks < NIS
        sw = tl.load(sd_ptr + n_in[:, None] * sd_n + ks[None, :], mask=ksm[None, :], other=0.0)
        g = tl.load(sp_ptr + t * sp_t + ks, mask=ksm, other=0.0).to(tl.float32)
        u = tl.load(sp_ptr + t * sp_t + NIS + ks, mask=ksm, other=0.0).to(tl.float32)
        gl = tl.load(sg_ptr + t * sg_t).to(tl.float32)
    # Everything above is weights or outputs of the router and of the projection before it (launched before the
    # gate/up kernel): under PDL it streams while gate/up finishes. Only the activations need the wait.
    pdl_wait(PDL)
    a = tl.load(act_ptr + p[:, None] * NI + kk[None, :], mask=km[None, :], other=0.0).to(tl.float32)
    parts = tl.sum(w.to(tl.float32) * a[:, None, :], 2)          # [KP, BN]: each expert's dot, fp32
    total = tl.sum(parts * rw[:, None], 0)                      # weighted, summed over the k experts
    if HAS_SHARED:
        sa = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty).to(tl.float32)
        total += tl.sum(sw.to(tl.float32) * sa[None, :], 1) / (1.0 + tl.exp(-gl))
    tl.store(out_ptr + t * so_t + n, total.to(out_ptr.dtype.element_ty), mask=nm)


def _block_n(programs_per_tile: int, width: int, sm_count: int) -> int:
    # Rows per program: enough programs to cover the SMs about twice (a GEMV is bandwidth-bound: more loads in
    # flight), but at least 8 rows so each program still streams a useful tile.
    target = 2 * sm_count
    bn = 64
    while bn > 8 and programs_per_tile * triton.cdiv(width, bn) < target:
        bn //= 2
    return bn


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def moe_experts_gemv(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, shared: SharedExpert | None, *, tune: dict | None = None) -> torch.Tensor:
    """The decode path of :func:`ninfer.ops.triton.moe.moe_experts` (same contract; inputs already checked:
    one dtype, last dims contiguous). ``tune`` overrides the launch shape for tools/gpu_moe_gemv_sweep.py:
    ``bn1``/``bk1``/``warps1`` (gate/up) and ``bn2``/``warps2`` (down)."""
    tune = tune or {}
    t_len, hidden = x.shape
    top_k = ids.shape[1]
    inter = gate_up.shape[1] // 2
    out = torch.empty((t_len, hidden), dtype=x.dtype, device=x.device)
    if t_len == 0:
        return out
    ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
    rw = weights.float().contiguous()
    sms = _sm_count(x.device)
    interp = x.device.type != "cuda"
    kw1 = {} if interp else {"num_warps": tune.get("warps1", 4)}
    kw2 = {} if interp else {"num_warps": tune.get("warps2", 4)}
    act = torch.empty((t_len * top_k, inter), dtype=x.dtype, device=x.device)
    # A [BN, BK] fp32 accumulator per operand: BN * BK <= _TILE keeps it in registers (BN = 32 x BK = 512
    # spills, and a spilling kernel is several times slower).
    bk1 = tune.get("bk1") or min(_BK_GATE_UP, triton.next_power_of_2(hidden))
    bn1 = tune.get("bn1") or min(_block_n(t_len * top_k, inter, sms), max(1, _TILE // bk1))
    _gate_up_gemv_kernel[(t_len * top_k, triton.cdiv(inter, bn1))](
        x, gate_up, ids, act, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOPK=top_k, BN=bn1, BK=bk1, EVEN=hidden % bk1 == 0, **kw1, **pdl(x))
    if shared is not None:
        proj, sdown, glog = shared.projected, shared.down, shared.gate_logit
        nis = sdown.shape[1]
        sp_t, sd_n, sg_t = proj.stride(0), sdown.stride(0), glog.stride(0)
    else:  # unused pointers (HAS_SHARED=False compiles the branch away)
        proj = sdown = glog = x
        nis, sp_t, sd_n, sg_t = 0, 0, 0, 0
    bk2 = min(_BK_DOWN_MAX, triton.next_power_of_2(max(inter, nis, 16)))
    if tune.get("down", "one_shot") == "one_shot" and inter <= _BK_DOWN_MAX and nis <= _BK_DOWN_MAX:
        # [KP, BN, I] weights + [KP, I] activations in registers: BN = 4 at k = 8, I = 512 with 8 warps (64
        # weight elements per thread), H / 4 programs per token.
        kp = triton.next_power_of_2(top_k)
        bk = triton.next_power_of_2(max(inter, 16))
        bks = triton.next_power_of_2(max(nis, 16))
        bn2 = tune.get("bn2") or max(1, min(16, _ONE_SHOT_TILE // (kp * bk)))
        kw2 = {} if interp else {"num_warps": tune.get("warps2", 8)}
        _down_gemv_one_shot_kernel[(t_len, triton.cdiv(hidden, bn2))](
            act, down, ids, rw, out, proj, sdown, glog, hidden, inter, nis,
            down.stride(0), down.stride(1), out.stride(0), sp_t, sd_n, sg_t,
            TOPK=top_k, KP=kp, BN=bn2, BK=bk, BKS=bks, HAS_SHARED=shared is not None, **kw2, **pdl(x))
        return out
    bn2 = tune.get("bn2") or min(_block_n(t_len, hidden, sms), max(1, _TILE // bk2))
    _down_gemv_kernel[(t_len, triton.cdiv(hidden, bn2))](
        act, down, ids, rw, out, proj, sdown, glog, hidden, inter, nis,
        down.stride(0), down.stride(1), out.stride(0), sp_t, sd_n, sg_t,
        TOPK=top_k, BN=bn2, BK=bk2, ONE_TILE=inter <= bk2, HAS_SHARED=shared is not None, **kw2, **pdl(x))
    return out
