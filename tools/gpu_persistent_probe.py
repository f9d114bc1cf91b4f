#!/usr/bin/env python3
"""Does a device-side grid barrier beat a kernel boundary at decode? A probe for issue 39's persistent decode.

A decode step at small shapes is bounded by its chain of dependent launches, not by its bytes (docs/dev/perf-log.md:
the 0.8B spends ~24 us a layer on ~10 us of weights). Before a persistent decode is built, this probe measures the
one thing it rests on, on the simplest block that has the chain: a stack of ``L`` dense SwiGLU MLP blocks at B = 1,

    res' = x + res;  h = rms_norm_unit_offset(res');  act = silu(gate h) * (up h);  x' = down act

run four ways on the same weights, each captured as one CUDA graph:

- ``ops``: today's ops, two launches a block (``add_rms_norm_unit_offset_swiglu``, then ``linear``), with PDL;
- ``split``: this probe's kernel, one launch per phase (2L launches): its efficiency without any barrier;
- ``layer``: one persistent launch per block (its two phases meet at one grid barrier), with PDL between blocks;
- ``chain``: one persistent launch for all L blocks (2L - 1 grid barriers, no launch boundary).

Beside them, the cost of one grid barrier alone (a kernel of 64 barriers and nothing else) against one launch
boundary (64 empty PDL-launched kernels in a graph), at one and two programs an SM; and the persistent forms with
wider tiles (``--rows``: 2, 4 or 8 rows of each phase a tile), which put more weight bytes in flight per program.

A persistent program walks its phase's row tiles grid-stride and requests the first weight tile of its next
phase before it waits at the barrier (weights depend on nothing), so the wait overlaps a load instead of leaving the
memory system idle. Every variant's final output is compared with ``ops`` (max relative difference); ``split``,
``layer`` and ``chain`` run the same arithmetic and must agree bitwise.

The grid barrier is an arrival counter: each program adds 1 (release) after a CTA barrier and spins until the count
reaches ``syncs * programs`` (acquire); the last program out resets it. It needs every program resident at once,
so the grid is at most the SM count times the programs one SM holds (``--programs-per-sm``). Under
``TRITON_INTERPRET=1`` programs run one after another, so only a one-program grid can take the persistent path
there (the CPU tests do exactly that).

    python3 tools/gpu_persistent_probe.py --out $OUT/persistent.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from ninfer.ops.triton._common import INTERPRET, cast, next_pow2, pdl, pdl_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_profile import graph_us, require_cuda, write_report  # noqa: E402

# (name, hidden, intermediate, blocks): the dense MLP of Qwen3.5-0.8B, 4B and 9B.
SHAPES = [("0.8b mlp", 1024, 3584, 16), ("4b mlp", 2560, 9216, 8), ("9b mlp", 4096, 12288, 6)]
# Rows per tile by default: gate/up pairs of phase 1, down rows of phase 2 (the widths of today's GEMVs);
# ``--rows`` tries wider tiles (more weight bytes in flight per program) where a tile stays within MAX_TILE elements.
ROWS = 2
MAX_TILE = 8192
BK2 = 4096


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until every program of the grid has arrived: the count reaches ``target`` (syncs so far x programs)."""
    tl.debug_barrier()   # every thread's stores are issued before the (release) arrival
    tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    while tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target:
        pass   # spin: the loop's condition (an acquire read of the count) is the whole wait
    tl.debug_barrier()


@triton.jit
def _sync_kernel(bar_ptr, SYNCS: tl.constexpr, PDL: tl.constexpr):
    """``SYNCS`` grid barriers and nothing else: what one costs, against a launch boundary (:func:`_empty_kernel`)."""
    pdl_wait(PDL)
    nprog = tl.num_programs(0)
    for s in range(1, SYNCS + 1):
        _grid_sync(bar_ptr, s * nprog)
    done = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _empty_kernel(bar_ptr, PDL: tl.constexpr):
    pdl_wait(PDL)


def barrier_us(programs: int, syncs: int = 64, replays: int = 20) -> dict:
    """Microseconds per grid barrier of ``programs`` programs, and per launch boundary of as many empty
    PDL-launched kernels in one CUDA graph (the boundary a persistent kernel replaces)."""
    bar = torch.zeros(2, device="cuda", dtype=torch.int32)
    launch = pdl(bar)
    sync = graph_us(lambda: _sync_kernel[(programs,)](bar, SYNCS=syncs, **launch), replays)
    empty = graph_us(lambda: [_empty_kernel[(programs,)](bar, **launch) for _ in range(syncs)], replays)
    one = graph_us(lambda: _sync_kernel[(programs,)](bar, SYNCS=1, **launch), replays)
    return {"programs": programs, "us_per_sync": (sync - one) / (syncs - 1), "us_per_launch": empty / syncs}


@triton.jit
def _mlp_kernel(xs_ptr, res_ptr, nw_ptr, w1_ptr, w2_ptr, act_ptr, bar_ptr, eps, H, NI, LAYER0, LAYERS,
                BKH: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
                PHASE: tl.constexpr, PERSIST: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    # PERSIST: blocks LAYER0 .. LAYER0 + LAYERS - 1, both phases, grid barriers between them. Otherwise one phase
    # (PHASE 1 or 2) of block LAYER0. xs[blk] is block blk's input x (xs[blk + 1] its output), res[blk] its residual input.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    kk = tl.arange(0, BKH)
    km = kk < H
    k2 = tl.arange(0, BK2)
    r1 = tl.arange(0, BN1)
    r2 = tl.arange(0, BN2)
    n1 = tl.cdiv(NI, BN1)
    n2 = tl.cdiv(H, BN2)
    syncs = 0
    # The first weight tile of this program's first phase: before the PDL wait (weights are no kernel's output).
    if PERSIST or PHASE == 1:
        n = pid * BN1 + r1
        n_in = tl.where(n < NI, n, 0)
        g_next = tl.load(w1_ptr + LAYER0 * 2 * NI * H + n_in[:, None] * H + kk[None, :],
                         mask=(n < NI)[:, None] & km[None, :], other=0.0)
        u_next = tl.load(w1_ptr + LAYER0 * 2 * NI * H + (NI + n_in)[:, None] * H + kk[None, :],
                         mask=(n < NI)[:, None] & km[None, :], other=0.0)
    if PERSIST or PHASE == 2:
        m = pid * BN2 + r2
        d_next = tl.load(w2_ptr + LAYER0 * H * NI + tl.where(m < H, m, 0)[:, None] * NI + k2[None, :],
                         mask=(m < H)[:, None] & (k2[None, :] < NI), other=0.0)
    pdl_wait(PDL)
    for blk in range(LAYER0, LAYER0 + LAYERS):
        if PERSIST or PHASE == 1:
            # Phase 1: h from x and the residual (every program, from L2), then gate/up row pairs -> act.
            x = tl.load(xs_ptr + blk * H + kk, mask=km, other=0.0).to(tl.float32)
            rr = tl.load(res_ptr + blk * H + kk, mask=km, other=0.0).to(tl.float32)
            res = cast(x + rr, xs_ptr.dtype.element_ty, INTERP)
            rf = res.to(tl.float32)
            nw = tl.load(nw_ptr + blk * H + kk, mask=km, other=0.0).to(tl.float32)
            h = cast(rf * tl.rsqrt(tl.sum(rf * rf, 0) / H + eps) * (1.0 + nw), xs_ptr.dtype.element_ty,
                     INTERP).to(tl.float32)
            tl.store(res_ptr + (blk + 1) * H + kk, res, mask=km & (kk * 0 + pid == 0))   # program 0 only (a tensor mask: the interpreter)
            for t in range(pid, n1, nprog):
                n = t * BN1 + r1
                g = cast(tl.sum(g_next.to(tl.float32) * h[None, :], 1), xs_ptr.dtype.element_ty, INTERP)
                u = cast(tl.sum(u_next.to(tl.float32) * h[None, :], 1), xs_ptr.dtype.element_ty, INTERP)
                nn = (t + nprog) * BN1 + r1   # the next tile in flight while this one is reduced
                nn_in = tl.where(nn < NI, nn, 0)
                g_next = tl.load(w1_ptr + blk * 2 * NI * H + nn_in[:, None] * H + kk[None, :],
                                 mask=(nn < NI)[:, None] & km[None, :], other=0.0)
                u_next = tl.load(w1_ptr + blk * 2 * NI * H + (NI + nn_in)[:, None] * H + kk[None, :],
                                 mask=(nn < NI)[:, None] & km[None, :], other=0.0)
                gf, uf = g.to(tl.float32), u.to(tl.float32)
                a = cast(gf / (1.0 + tl.exp(-gf)) * uf, xs_ptr.dtype.element_ty, INTERP)
                tl.store(act_ptr + blk * NI + n, a, mask=n < NI)
            if PERSIST:
                syncs += 1
                _grid_sync(bar_ptr, syncs * nprog)
        if PERSIST or PHASE == 2:
            # Phase 2: down rows over act (K = NI, in BK2 chunks; the first chunk of a tile is already loaded).
            for t in range(pid, n2, nprog):
                m = t * BN2 + r2
                m_in = tl.where(m < H, m, 0)
                a0 = tl.load(act_ptr + blk * NI + k2, mask=k2 < NI, other=0.0).to(tl.float32)
                acc = tl.sum(d_next.to(tl.float32) * a0[None, :], 1)
                for k0 in range(BK2, NI, BK2):
                    w = tl.load(w2_ptr + blk * H * NI + m_in[:, None] * NI + k0 + k2[None, :],
                                mask=(k0 + k2[None, :]) < NI, other=0.0).to(tl.float32)
                    ak = tl.load(act_ptr + blk * NI + k0 + k2, mask=(k0 + k2) < NI, other=0.0).to(tl.float32)
                    acc += tl.sum(w * ak[None, :], 1)
                mm = (t + nprog) * BN2 + r2
                d_next = tl.load(w2_ptr + blk * H * NI + tl.where(mm < H, mm, 0)[:, None] * NI + k2[None, :],
                                 mask=(mm < H)[:, None] & (k2[None, :] < NI), other=0.0)
                tl.store(xs_ptr + (blk + 1) * H + m, cast(acc, xs_ptr.dtype.element_ty, INTERP), mask=m < H)
            if PERSIST:
                # The next block's first tiles, requested before the wait (masked off after the last block).
                nxt = blk + 1 < LAYER0 + LAYERS
                i_lim = tl.where(nxt, NI, 0)   # no rows after the last block
                h_lim = tl.where(nxt, H, 0)
                n = pid * BN1 + r1
                n_in = tl.where(n < NI, n, 0)
                g_next = tl.load(w1_ptr + (blk + 1) * 2 * NI * H + n_in[:, None] * H + kk[None, :],
                                 mask=(n < i_lim)[:, None] & km[None, :], other=0.0)
                u_next = tl.load(w1_ptr + (blk + 1) * 2 * NI * H + (NI + n_in)[:, None] * H + kk[None, :],
                                 mask=(n < i_lim)[:, None] & km[None, :], other=0.0)
                m = pid * BN2 + r2
                d_next = tl.load(w2_ptr + (blk + 1) * H * NI + tl.where(m < H, m, 0)[:, None] * NI + k2[None, :],
                                 mask=(m < h_lim)[:, None] & (k2[None, :] < NI), other=0.0)
                if nxt:
                    syncs += 1
                    _grid_sync(bar_ptr, syncs * nprog)
    if PERSIST:
        # The last program out resets the counter for the next launch: every program has left its last wait.
        done = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == nprog - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


class MLPStack:
    """``L`` MLP blocks' weights and activation buffers; ``xs[0]``/``res[0]`` hold the input."""

    def __init__(self, hidden: int, inter: int, layers: int, device, dtype, seed: int = 0, rows: int = ROWS) -> None:
        self.rows = rows   # rows per tile of both phases
        g = torch.Generator(device=device).manual_seed(seed)
        self.h, self.i, self.layers = hidden, inter, layers
        self.w1 = (torch.randn(layers, 2 * inter, hidden, generator=g, device=device) * hidden ** -0.5).to(dtype)
        self.w2 = (torch.randn(layers, hidden, inter, generator=g, device=device) * inter ** -0.5).to(dtype)
        self.nw = (torch.randn(layers, hidden, generator=g, device=device) * 0.1).to(dtype)
        self.xs = torch.zeros(layers + 1, hidden, device=device, dtype=dtype)
        self.res = torch.zeros(layers + 1, hidden, device=device, dtype=dtype)
        self.xs[0] = torch.randn(hidden, generator=g, device=device).to(dtype)
        self.res[0] = torch.randn(hidden, generator=g, device=device).to(dtype)
        self.act = torch.zeros(layers, inter, device=device, dtype=dtype)
        self.bar = torch.zeros(2, device=device, dtype=torch.int32)
        self.eps = 1e-6

    def weight_bytes(self) -> int:
        return (self.w1.numel() + self.w2.numel()) * self.w1.element_size()

    def _launch(self, grid: int, layer0: int, layers: int, phase: int, persist: bool, warps: int):
        kw = {} if INTERPRET else {"num_warps": warps}
        launch = pdl(self.xs) if persist else {"PDL": False}
        return _mlp_kernel[(grid,)](self.xs, self.res, self.nw, self.w1, self.w2, self.act, self.bar, self.eps, self.h,
                             self.i, layer0, layers, BKH=next_pow2(self.h), BN1=self.rows, BN2=self.rows,
                             BK2=min(BK2, next_pow2(self.i)), PHASE=phase, PERSIST=persist, INTERP=INTERPRET,
                             **launch, **kw)

    def split(self, warps: int = 4) -> None:
        """One launch per phase, grids as wide as the tiles (no barrier)."""
        for blk in range(self.layers):
            self._launch(triton.cdiv(self.i, self.rows), blk, 1, 1, False, warps)
            self._launch(triton.cdiv(self.h, self.rows), blk, 1, 2, False, warps)

    def layer(self, programs: int, warps: int = 4) -> None:
        """One persistent launch per block."""
        for blk in range(self.layers):
            self._launch(programs, blk, 1, 0, True, warps)

    def chain(self, programs: int, warps: int = 4) -> None:
        """One persistent launch for every block."""
        self._launch(programs, 0, self.layers, 0, True, warps)

    def resident_per_sm(self, warps: int) -> int:
        """How many persistent programs one SM holds at once, from the compiled kernel's registers and shared
        memory (compiled by a one-program launch, which cannot hang): a larger grid's barrier would wait forever
        for programs that cannot start."""
        k = self._launch(1, 0, 1, 0, True, warps)
        props = torch.cuda.get_device_properties(self.xs.device)
        # Hopper's per-SM limits where this torch does not report them.
        regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, k.n_regs * 32 * warps)
        smem = k.metadata.shared
        by_smem = getattr(props, "shared_memory_per_multiprocessor", 228 << 10) // smem if smem else regs
        threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
        return max(0, min(regs, by_smem, threads))

    def ops(self) -> None:
        """Today's ops: the fused norm + gate/up + SwiGLU GEMV, then the down GEMV, per block."""
        from ninfer.ops.triton import linear
        x, res = self.xs[0:1], self.res[0:1]
        for blk in range(self.layers):
            act, _, res = linear.add_rms_norm_unit_offset_swiglu(x, res, self.nw[blk], self.eps, self.w1[blk])
            x = linear.linear(act, self.w2[blk])
        self.xs[self.layers].copy_(x[0])   # one small copy per stack, so the outputs compare

    def reference(self) -> torch.Tensor:
        """The stack in fp32 torch with the kernels' roundings: the final block's output."""
        dt = self.xs.dtype
        x, r = self.xs[0].float(), self.res[0].float()
        for blk in range(self.layers):
            res = (x + r).to(dt).float()
            h = (res * torch.rsqrt((res * res).mean() + self.eps) * (1.0 + self.nw[blk].float())).to(dt).float()
            gu = (self.w1[blk].float() @ h).to(dt).float()
            g, u = gu[:self.i], gu[self.i:]
            act = (torch.nn.functional.silu(g) * u).to(dt).float()
            x, r = (self.w2[blk].float() @ act).to(dt).float(), res
        return x


def _with_rows(st: MLPStack, rows: int, mode: str, programs: int, warps: int) -> None:
    st.rows = rows
    getattr(st, mode)(programs, warps)
    st.rows = ROWS


def measure(args) -> dict:
    from ninfer.bench.limits import measure_copy_bandwidth
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy = measure_copy_bandwidth(dev, 1 << 30)
    report = {"device": torch.cuda.get_device_name(dev), "sms": sms, "copy_bytes_per_s": copy, "shapes": [],
              "barrier": [barrier_us(p) for p in (sms, 2 * sms)]}
    for b in report["barrier"]:
        print(f"grid barrier, {b['programs']} programs: {b['us_per_sync']:.2f} us; launch boundary (empty PDL "
              f"kernels in a graph): {b['us_per_launch']:.2f} us", flush=True)
    for name, hidden, inter, layers in SHAPES:
        st = MLPStack(hidden, inter, layers, dev, torch.bfloat16)
        variants = {"ops": st.ops, "split": st.split}
        for rows in args.rows:
            if rows * next_pow2(hidden) > MAX_TILE:
                continue
            st.rows = rows
            for per_sm in args.programs_per_sm:
                for warps in args.warps:
                    if per_sm > st.resident_per_sm(warps):
                        print(f"{name}: {per_sm} programs an SM at {warps} warps and {rows} rows cannot all be "
                              f"resident; skipped", flush=True)
                        continue
                    for mode in ("layer", "chain"):
                        variants[f"{mode} r{rows} p{per_sm * sms} w{warps}"] = functools.partial(
                            _with_rows, st, rows, mode, per_sm * sms, warps)
        st.rows = ROWS
        ref = st.reference()
        row = {"shape": name, "hidden": hidden, "inter": inter, "blocks": layers, "weight_bytes": st.weight_bytes(),
               "variants": {}}
        outs = {}
        for vname, fn in variants.items():
            st.xs[1:].zero_()
            fn()
            torch.cuda.synchronize()
            outs[vname] = st.xs[layers].clone()
            us = graph_us(fn, args.replays)
            err = float((outs[vname].float() - ref).abs().max() / ref.abs().max())
            row["variants"][vname] = {
                "us_per_block": us / layers, "of_copy_ceiling": st.weight_bytes() / (us * 1e-6) / copy,
                "rel_err_vs_fp32": err,
                "bitwise_eq_split": bool(torch.equal(outs[vname], outs["split"])) if "split" in outs else None,
                "rel_diff_vs_ops": float((outs[vname].float() - outs["ops"].float()).abs().max()
                                         / outs["ops"].float().abs().max())}
            print(f"{name:10s} {vname:20s} {us / layers:8.2f} us/block "
                  f"{100 * row['variants'][vname]['of_copy_ceiling']:5.1f}% of copy  err {err:.2e}", flush=True)
        report["shapes"].append(row)
        torch.cuda.empty_cache()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8],
                    help="rows per tile of the persistent forms (a tile of more than 8,192 weights is skipped)")
    args = ap.parse_args(argv)
    if not require_cuda("gpu_persistent_probe"):
        return 2
    report = measure(args)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
