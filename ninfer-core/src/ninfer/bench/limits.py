"""The two ceilings a benchmark figure is compared with, measured on the device in the same run.

- Copy bandwidth: a large device-to-device ``copy_`` of random data; bytes moved = bytes read + bytes
  written (2 x buffer size), the same counting the decode accounting uses for what a step must move.
- Matmul peak: ``torch.matmul`` of random ``n x n`` matrices in the run dtype, ``2 n^3`` FLOPs; several
  input sets are rotated so repeated runs do not just measure a cache.

Timing: warm-up runs first (allocation, library handles, kernel selection stay out), then the median
of ``repeats`` runs; CUDA runs are timed with events, CPU runs with ``perf_counter``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CUDA_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 256 << 20
CUDA_MATMUL_N = 8192
CPU_MATMUL_N = 1024
_MATMUL_SETS = 3


@dataclass(frozen=True)
class DeviceLimits:
    """Measured ceilings. Invariant: every rate is > 0 (a measurement that timed 0 s raises).

    ``copy_bytes_per_s`` is measured before the workload, on an empty device; ``copy_bytes_per_s_after`` (None
    until :func:`remeasure_copy`) is the same copy after it, the engine closed and the GPU idle a few seconds. The
    ceiling drifts with what the device just ran (tools/gpu_copy_ceiling.py measures it; docs/dev/perf-log.md), so a
    figure near a target is given against both."""

    device: str
    copy_buffer_bytes: int
    copy_bytes_per_s: float       # (read + write) / time
    matmul_n: int
    matmul_dtype: str
    matmul_flops_per_s: float
    copy_bytes_per_s_after: float | None = None


def run_seconds(fn: Callable[[], object], device: torch.device, *, repeats: int, warmup: int) -> list[float]:
    """Wall time of each of ``repeats`` runs of ``fn`` after ``warmup`` untimed ones (CUDA: events)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn: Callable[[], object], device: torch.device, *, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` untimed ones."""
    t = statistics.median(run_seconds(fn, device, repeats=repeats, warmup=warmup))
    if not t > 0:
        raise RuntimeError(f"a limit measurement on {device} timed {t} s; the buffer is too small to time")
    return t


def measure_copy_bandwidth(device: torch.device, nbytes: int, *, repeats: int = 10, warmup: int = 2) -> float:
    """(bytes read + bytes written) per second of one ``nbytes`` device-to-device copy."""
    n = max(1, nbytes // 4)
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = median_seconds(lambda: dst.copy_(src), device, repeats=repeats, warmup=warmup)
    return 2 * n * 4 / t


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, n: int, *, repeats: int = 10,
                        warmup: int = 2) -> float:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype`` (random inputs, rotated among a few sets)."""
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [(torch.randn(n, n, generator=gen, device=device).to(dtype),
             torch.randn(n, n, generator=gen, device=device).to(dtype)) for _ in range(_MATMUL_SETS)]
    out = torch.empty(n, n, device=device, dtype=dtype)
    turn = [0]

    def one():
        a, b = sets[turn[0] % len(sets)]
        turn[0] += 1
        torch.matmul(a, b, out=out)

    t = median_seconds(one, device, repeats=repeats, warmup=warmup)
    return 2.0 * n ** 3 / t


def _prime_matmul(device: torch.device, dtype: torch.dtype) -> None:
    """One small matmul on an emptied CUDA cache: the library handle and its workspace get a segment of their own."""
    torch.cuda.empty_cache()
    a = torch.ones(64, 64, device=device, dtype=dtype)
    torch.matmul(a, a)
    torch.cuda.synchronize(device)


def measure_limits(device: torch.device, dtype: torch.dtype, *, copy_bytes: int | None = None,
                   matmul_n: int | None = None, repeats: int = 10) -> DeviceLimits:
    """Both ceilings; sizes default to ones that dwarf a large GPU's L2 (CUDA) or the CPU caches. Buffers are freed
    (and the CUDA cache emptied) before returning, so the engine started next sees the memory.

    On CUDA the matmul library's workspace, which lives as long as the process, is made first, on an empty cache,
    and the cache is emptied after each measurement: a workspace carved from a freed 1 GiB copy buffer still in the
    cache would pin that whole segment, and the engine's budget would count it as memory in use."""
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (CUDA_COPY_BYTES if cuda else CPU_COPY_BYTES)
    matmul_n = matmul_n or (CUDA_MATMUL_N if cuda else CPU_MATMUL_N)
    if cuda:
        _prime_matmul(device, dtype)
    bw = measure_copy_bandwidth(device, copy_bytes, repeats=repeats)
    if cuda:
        torch.cuda.empty_cache()
    peak = measure_matmul_peak(device, dtype, matmul_n, repeats=repeats)
    if cuda:
        torch.cuda.empty_cache()
    return DeviceLimits(device=str(device), copy_buffer_bytes=copy_bytes, copy_bytes_per_s=bw, matmul_n=matmul_n,
                        matmul_dtype=str(dtype).removeprefix("torch."), matmul_flops_per_s=peak)


# Idle time before the copy is measured again on a GPU. Right after a decode bench the GPU copies markedly slower
# for about a second, which would inflate every "(after)" share; a few seconds idle restores the ceiling
# (docs/dev/perf-log.md, corrections).
AFTER_SETTLE_S = 3.0


def remeasure_copy(limits: DeviceLimits, device: torch.device, *, repeats: int = 10,
                   settle_s: float | None = None) -> DeviceLimits:
    """``limits`` with ``copy_bytes_per_s_after``: the same copy measured again (after the workload), on a GPU
    after ``settle_s`` (default :data:`AFTER_SETTLE_S`) seconds of idle time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        time.sleep(AFTER_SETTLE_S if settle_s is None else settle_s)
    after = measure_copy_bandwidth(device, limits.copy_buffer_bytes, repeats=repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dataclasses.replace(limits, copy_bytes_per_s_after=after)
