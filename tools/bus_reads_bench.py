#!/usr/bin/env python3
"""Bus reads of host experts alone (issue 36; docs/memory.md "Bus reads"): does the device's share add to the host's?

One MoE layer's routed experts in page-locked host memory (``--experts`` of ``--hidden`` x ``--inter``, bf16), one
decode call of ``--tokens`` tokens routed to ``--k`` of them at random (new experts each repeat). For each count
``d`` of ``--ranks`` (the choices of each token the device reads):

- ``bus_ms``: the device's ``moe_experts`` reading the last ``d`` choices in place over the bus, timed to its
  completion, and the rate it read their distinct experts' bytes (``bus_gbs``);
- ``host_ms``: the host's native kernel computing the other ``k - d`` choices, with ``--threads`` threads;
- ``both_ms``: the two at once, as a host-expert layer runs them: the device's share queued, then the host's,
  then a wait for the device. If the two shares add up, ``both_ms`` is about the larger of the first two.

Also in the report: the page-locked host-to-device copy rate and the host's read rate (the ceilings of each side).

    python3 tools/bus_reads_bench.py --threads 8 --tokens 1,8 --ranks 0,2,3,4,5,8 --out $OUT/bus-reads.json

``--device cpu`` runs the same code path on the CPU (the device's op then reads the same memory; a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from gpu_kernel_profile import write_report
from host_kernel_bench import read_bandwidth


def _ops(device: torch.device):
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    return resolve_ops(get_registry().ops, device.type, torch.bfloat16)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Step:
    """One call's two shares over fixed activations and banks, for routings ``ids_h`` (``[T, k]`` on the host): the
    device's (the last ``ranks`` choices, read over the bus) and the host's (the others)."""

    def __init__(self, ops, device, x, w, x_h, w_h, gate_up, down, rows, ranks: int) -> None:
        self.ops, self.device, self.x, self.w, self.x_h, self.w_h = ops, device, x, w, x_h, w_h
        self.gate_up, self.down, self.rows, self.ranks = gate_up, down, rows, ranks
        self.k = w_h.shape[1]
        self.skip = torch.zeros(w_h.shape, dtype=torch.bool)
        self.skip[:, self.k - ranks:] = True

    def bus(self, ids_h: torch.Tensor):
        if self.ranks == 0:
            return None
        ids, first = ids_h.to(self.device), self.k - self.ranks
        return self.ops.moe_experts(self.x, self.w[:, first:].contiguous(), ids[:, first:].contiguous(),
                                    self.gate_up, self.down)

    def host(self, ids_h: torch.Tensor):
        from ninfer_qwen3_5.layers.host_compute import routed_sum

        if self.ranks == self.k:
            return None
        return routed_sum(self.x_h, self.w_h, ids_h, self.gate_up, self.down, skip=self.skip, rows=self.rows)

    def both(self, ids_h: torch.Tensor):
        part = self.bus(ids_h)   # queued first, as a layer queues it before its host share
        self.host(ids_h)
        return part


def measure(args) -> dict:
    from ninfer_qwen3_5.layers.expert_costs import host_to_device_bandwidth
    from ninfer_qwen3_5.layers.host_native import NativeRows

    device = torch.device(args.device)
    pin = device.type == "cuda"
    g = torch.Generator().manual_seed(args.seed)
    e, h, i, k = args.experts, args.hidden, args.inter, args.k
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * 0.02).to(torch.bfloat16)
    if pin:
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    expert_bytes = 3 * h * i * 2
    torch.set_num_threads(args.threads)
    rows = NativeRows(args.threads)
    ops = _ops(device)
    report = {"device": str(device), "threads": args.threads, "hidden": h, "inter": i, "experts": e, "k": k,
              "copy_gbs": host_to_device_bandwidth(device) / 1e9 if pin else None,
              "host_read_gbs": read_bandwidth(args.threads) / 1e9, "runs": []}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x_h = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
        w_h = torch.softmax(torch.randn(tokens, k, generator=g), -1)
        x, w = x_h.to(device), w_h.to(device)
        for d in (int(r) for r in args.ranks.split(",")):
            calls = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
                     for _ in range(args.repeats + 1)]
            step = Step(ops, device, x, w, x_h, w_h, gate_up, down, rows, d)
            run = {"tokens": tokens, "ranks": d}
            for name, fn in (("bus", step.bus), ("host", step.host), ("both", step.both)):
                fn(calls[-1])   # compiles or starts the thread team
                _sync(device)
                times = []
                for ids_h in calls[:-1]:
                    t0 = time.perf_counter()
                    fn(ids_h)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                run[f"{name}_ms"] = 1e3 * sorted(times)[len(times) // 2]
            distinct = sum(len(set(c[:, k - d:].reshape(-1).tolist())) for c in calls[:-1]) / len(calls[:-1])
            run["bus_gbs"] = distinct * expert_bytes / (run["bus_ms"] / 1e3) / 1e9 if d else None
            report["runs"].append(run)
            print(f"T={tokens} d={d}: bus {run['bus_ms']:.3f} ms"
                  + (f" ({run['bus_gbs']:.1f} GB/s)" if d else "")
                  + f", host {run['host_ms']:.3f} ms, both {run['both_ms']:.3f} ms", flush=True)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=256, help="experts in the bank (random routing among them)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--ranks", default="0,2,3,4,5,8", help="choices of each token the device reads, comma list")
    ap.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON too")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bus_reads_bench.py: no CUDA device here (--device cpu runs the code path on the CPU)", file=sys.stderr)
        return 2
    if any(not 0 <= int(r) <= args.k for r in args.ranks.split(",")):
        print(f"bus_reads_bench.py: --ranks must be counts from 0 to --k ({args.k})", file=sys.stderr)
        return 2
    write_report(args.out, measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
