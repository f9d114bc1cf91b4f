#!/usr/bin/env python3
"""The host-expert kernels alone (issue 36; docs/memory.md "Host experts"): one MoE layer's routed sum on the CPU.

For each stored format and host kernel, times ``routed_sum`` (what a host-expert layer runs on the host) over
random routing of ``--tokens`` tokens to ``--k`` of ``--experts`` experts of ``--hidden`` x ``--inter``, and
reports milliseconds and the rate at which the layer's distinct routed experts' stored bytes were read, against
the host's read bandwidth measured in the same run (the maximum of a 512 MiB bf16 buffer, same threads): the
physical limit of a step that reads each routed expert once. No model and no GPU are needed.

    python3 tools/host_kernel_bench.py --threads 8 --out $OUT/host-kernels.json
    python3 tools/host_kernel_bench.py --threads 4,8,12,16 --formats bf16 --kernels native --tokens 1,8
    python3 tools/host_kernel_bench.py --formats bf16,q4_g64_fp16 --kernels torch,native,compiled --tokens 1,8
    python3 tools/host_kernel_bench.py --threads 8,16 --formats bf16 --kernels native --tokens 1 --breakdown
    python3 tools/host_kernel_bench.py --threads 8,16 --kernels native --bf16-dot 0,1 --tokens 1,8

``--breakdown`` (native kernel) splits a call's time: the C kernel alone on prepared arguments (``kernel_ms``, the
median call), the same kernel with no pairs (``empty_ms``: entering the thread team, the working buffer, the
phases' barriers), and both again after ``--gap-us`` of busy waiting before each call (``*_after_gap_ms``), as a
decode step's host calls are spaced by GPU work, during which idle OpenMP threads may go to sleep.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from gpu_kernel_profile import write_report

FORMATS = ("bf16", "q4_g64_fp16", "q8_g32_fp16")
KERNELS = ("torch", "native")


def read_bandwidth(threads: int, mib: int = 2048) -> float:
    """Bytes a second the host's ``threads`` read: the best of five maxima of a buffer of ``mib`` MiB read as int32
    (a reduction with next to no arithmetic a byte, and larger than a server's last-level cache). A bf16 maximum
    converts every element and measured about half of this on the development machine, which made the kernels'
    shares look twice as good as they are."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib << 18, dtype=torch.int32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.max()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def banks(fmt: str, experts: int, hidden: int, inter: int, seed: int, pinned: bool = False):
    """The (gate_up, down) banks routed_sum reads for ``fmt`` (a quantized bank as the host layer wraps it) and the
    stored bytes of one expert; with ``pinned`` (bf16 only), in page-locked memory as the engine loads them."""
    from ninfer.ops.reference.quantized import DecodedBank
    from ninfer.quant.groupwise import GROUPWISE
    from ninfer.quant.packed import PackedWeight

    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, k in ((2 * inter, hidden), (hidden, inter)):
        dense = torch.randn(experts * rows, k, generator=g) * 0.02
        if fmt == "bf16":
            bank = dense.to(torch.bfloat16).view(experts, rows, k)
            out.append(bank.pin_memory() if pinned else bank)
        elif pinned:
            raise SystemExit("--pinned measures bf16 banks only")
        else:
            out.append(PackedWeight(fmt, (experts, rows, k), GROUPWISE[fmt].encode(dense)))
    per_expert = sum(b.nbytes if isinstance(b, PackedWeight) else b.numel() * b.element_size() for b in out) / experts
    return [DecodedBank(b) if isinstance(b, PackedWeight) else b for b in out], per_expert


def kernel_runs(args) -> list[str]:
    """The kernels to time: ``--kernels``, with "native" once per build of ``--row-prefetch`` x ``--bf16-dot``
    ("native/pfN", "native/dotN", "native/pfN/dotM")."""
    out = []
    for kernel in args.kernels.split(","):
        if kernel == "native" and (args.row_prefetch or args.bf16_dot):
            for pf in args.row_prefetch.split(",") if args.row_prefetch else [""]:
                for dot in args.bf16_dot.split(",") if args.bf16_dot else [""]:
                    out.append("native" + (f"/pf{pf}" if pf else "") + (f"/dot{dot}" if dot else ""))
        else:
            out.append(kernel)
    return out


def rows_for(kernel: str, hidden: int, inter: int, threads: int):
    import os

    from ninfer_qwen3_5.layers import host_native
    from ninfer_qwen3_5.layers.host_compute import compiled_rows
    from ninfer_qwen3_5.layers.host_native import NativeRows

    if kernel == "torch":
        return None
    if kernel.startswith("native/"):   # that build of the kernel (each cached under its own key)
        for part in kernel.split("/")[1:]:
            env = host_native.ROW_PREFETCH_ENV if part.startswith("pf") else host_native.BF16_DOT_ENV
            os.environ[env] = part.removeprefix("pf").removeprefix("dot")
        host_native._library = host_native.load(host_native.build())   # noqa: SLF001 (a tool's A/B)
        return NativeRows(threads)
    if kernel == "native":
        return NativeRows(threads)
    if kernel == "compiled":
        return compiled_rows(hidden, inter, torch.bfloat16, threads)
    raise SystemExit(f"unknown kernel {kernel!r}: torch, native or compiled")


def measure(args, threads: int, bank_sets: dict) -> dict:
    """One thread count's report; ``bank_sets`` caches each format's banks across thread counts."""
    from ninfer_qwen3_5.layers.host_compute import routed_sum

    torch.set_num_threads(threads)
    limit = read_bandwidth(threads)
    report = {"threads": threads, "hidden": args.hidden, "inter": args.inter, "experts": args.experts,
              "k": args.k, "pinned": args.pinned, "read_bandwidth_gbs": limit / 1e9, "runs": []}
    g = torch.Generator().manual_seed(args.seed)
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
        if fmt not in bank_sets:
            bank_sets[fmt] = banks(fmt, args.experts, args.hidden, args.inter, args.seed, args.pinned)
        (gate_up, down), per_expert = bank_sets[fmt]
        for kernel in kernel_runs(args):
            if kernel == "compiled" and fmt != "bf16":
                continue   # the compiled kernel reads tensor banks only
            rows = rows_for(kernel, args.hidden, args.inter, threads)
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, args.hidden, generator=g).to(torch.bfloat16)
                w = torch.softmax(torch.randn(tokens, args.k, generator=g), -1)
                calls = [torch.stack([torch.randperm(args.experts, generator=g)[:args.k] for _ in range(tokens)])
                         for _ in range(args.repeats)]
                routed_sum(x, w, calls[0], gate_up, down, rows=rows)   # first touch, thread team start
                t0 = time.perf_counter()
                for ids in calls:
                    routed_sum(x, w, ids, gate_up, down, rows=rows)
                seconds = (time.perf_counter() - t0) / len(calls)
                distinct = sum(len(set(ids.reshape(-1).tolist())) for ids in calls) / len(calls)
                rate = distinct * per_expert / seconds
                run = {"format": fmt, "kernel": kernel, "tokens": tokens, "ms": seconds * 1e3,
                       "distinct_experts": distinct, "read_gbs": rate / 1e9, "share_of_read_bandwidth": rate / limit}
                if kernel.startswith("native"):   # whether this build and CPU have the bf16 dot products
                    from ninfer_qwen3_5.layers.host_native import bf16_dot

                    run["bf16_dot"] = bf16_dot()
                report["runs"].append(run)
                print(f"{fmt:12s} {kernel:8s} threads {threads:<3d} T={tokens:<3d} {run['ms']:8.3f} ms  "
                      f"{distinct:5.1f} experts  {run['read_gbs']:6.1f} GB/s = "
                      f"{100 * run['share_of_read_bandwidth']:5.1f}% of {limit / 1e9:.1f} GB/s", flush=True)
                if args.breakdown and kernel.startswith("native"):
                    run.update(breakdown(rows, x, w, calls, gate_up, down, args.gap_us))
                    print(f"{'':21s} kernel {run['kernel_ms']:.3f} ms, empty {run['empty_ms']:.3f} ms; after "
                          f"{run['gap_us']:.0f} us idle: kernel {run['kernel_after_gap_ms']:.3f} ms, empty "
                          f"{run['empty_after_gap_ms']:.3f} ms", flush=True)
    return report


def _median_ms(call, count: int, gap_us: float) -> float:
    """The median of ``count`` timed ``call()``s in milliseconds, each after ``gap_us`` of busy waiting."""
    times = []
    for _ in range(count):
        # Busy, not sleeping: the GPU work between a decode step's host calls keeps the engine's thread busy too.
        until = time.perf_counter() + gap_us * 1e-6
        t0 = time.perf_counter()
        while t0 < until:
            t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def breakdown(rows, x, w, routings, gate_up, down, gap_us: float) -> dict:
    """The C kernel's share of a native routed sum (module docstring, ``--breakdown``), over the same routings as
    the timed sums, in turn: one routing repeated would read its experts from the last-level cache."""
    from ninfer.ops.reference.quantized import DecodedBank
    from ninfer_qwen3_5.layers.host_compute import expert_groups
    from ninfer_qwen3_5.layers.host_native import library

    stored = [b.bank if isinstance(b, DecodedBank) else b for b in (gate_up, down)]
    wide = torch.promote_types(x.dtype, gate_up.dtype)
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32)
    prepared = []
    for ids in routings:
        order, groups = expert_groups(ids, None, stored[0].shape[0])
        tokens = order // ids.shape[1]
        prepared.append(rows.kernel_calls(out, x.index_select(0, tokens).to(wide), tokens, w.reshape(-1)[order],
                                          groups, *stored, wide))
    none = torch.zeros(1, dtype=torch.int64)   # no groups: first[0] = 0 pairs
    empty = list(prepared[0][0][0])
    empty[7:10] = [none.data_ptr(), none.data_ptr(), 0]
    fn = library().ninfer_routed_sum
    turn = iter(range(1 << 62))

    def kernel():
        for args, _ in prepared[next(turn) % len(prepared)]:
            fn(*args)

    def nothing():
        fn(*empty)

    count = len(prepared)
    return {"kernel_ms": _median_ms(kernel, count, 0.0), "empty_ms": _median_ms(nothing, count, 0.0),
            "kernel_after_gap_ms": _median_ms(kernel, count, gap_us),
            "empty_after_gap_ms": _median_ms(nothing, count, gap_us), "gap_us": gap_us}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64, help="experts in the bank (random routing among them)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--threads", default=str(torch.get_num_threads()),
                    help="host threads, or a comma list of counts to sweep in one process (the banks built once)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--breakdown", action="store_true",
                    help="native kernel: time the C call alone, an empty call, and both after --gap-us idle")
    ap.add_argument("--gap-us", type=float, default=1000.0,
                    help="busy wait before each --breakdown call (a decode step's GPU work between host calls)")
    ap.add_argument("--row-prefetch", default="",
                    help="native kernel: time these builds of NINFER_HOST_ROW_PREFETCH (e.g. 0,4,8) in one process")
    ap.add_argument("--bf16-dot", default="",
                    help="native kernel: time these builds of NINFER_HOST_BF16_DOT (0,1) in one process")
    ap.add_argument("--pinned", action="store_true",
                    help="bf16 banks in page-locked memory (torch's pinned allocator, as the engine loads host experts)")
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON too")
    args = ap.parse_args(argv)
    counts = [int(t) for t in str(args.threads).split(",")]
    bank_sets: dict = {}
    reports = [measure(args, t, bank_sets) for t in counts]
    report = reports[0] if len(reports) == 1 else {"by_threads": reports}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
