"""The measured costs of a host expert on a GPU run, and the per-call choice they drive: copy or compute.

A routed expert that is not cached on the device can be computed by the host's CPU (reading its weights from host
memory) or copied over the bus to a staging buffer and computed by the device. The two run at the same time: the
copies are queued on the device's stream before the host starts its share. So a layer call gives the copy engine
the busiest uncached experts (a copy costs the same whatever the token count; host compute grows with it) until
the two sides are about even: :meth:`ExpertCosts.copies` balances their estimated finishing times. A layer then
corrects the host's side by the host time it measures (``HostExperts.host_scale``): the start-up timing runs
alone, a layer's host share runs in the engine's thread among the device's work.

:func:`measure_expert_costs` measures the three constants once per model at start (about half a second):

- ``copy_s``: one expert's stored bytes (``3 * inter * hidden`` weights in the run dtype, or what a quantized
  expert takes) over the pinned host-to-device bandwidth;
- ``host_s`` / ``host_token_s``: the host computing one expert for one routed token, and each further token. A
  single-token expert is bound by reading its weights from memory (a GEMV), so this is timed on a bank larger than
  the CPU's caches, with the host thread count the layer will run with, through the same function the layer uses,
  on a bank stored as the model's is (a groupwise quantized format's planes filled with arbitrary codes, which the
  kernels' time does not depend on; dense in the run dtype otherwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from ninfer.ops.reference.quantized import DecodedBank
from ninfer.quant import PackedWeight
from ninfer.quant.groupwise import GROUPWISE

from ninfer_qwen3_5.layers.host_compute import routed_sum

#: Bytes of expert weights the host timing cycles through: more than a server CPU's last-level cache, so the
#: timing reads from memory as a layer call does.
HOST_PROBE_BYTES = 512 << 20
#: Experts per timed host call (a decode step's top-k is about this many).
HOST_PROBE_EXPERTS = 8


@dataclass(frozen=True)
class ExpertCosts:
    """Seconds, measured at start: ``copy_s`` to copy one expert to the device; ``host_s`` for the host to compute
    one expert for one token; ``host_token_s`` for each further token routed to it. Invariant: all three > 0."""

    copy_s: float
    host_s: float
    host_token_s: float

    def __post_init__(self) -> None:
        if not (self.copy_s > 0 and self.host_s > 0 and self.host_token_s > 0):
            raise ValueError(f"expert costs must be > 0, got {self}")

    def host_cost(self, tokens: int) -> float:
        return self.host_s + (tokens - 1) * self.host_token_s

    def copies(self, counts: list[int], host_scale: float = 1.0) -> int:
        """How many of the uncached experts with token ``counts`` (sorted descending) to copy, the busiest
        first: each move from the host to the copy engine must lower the later of the two sides' finishing
        times (they run concurrently). ``host_scale`` multiplies the host's costs (what the layer has measured
        its host time to be, against this estimate)."""
        host = host_scale * sum(self.host_cost(n) for n in counts)
        copy = 0.0
        moved = 0
        for n in counts:
            cost = host_scale * self.host_cost(n)
            if max(host - cost, copy + self.copy_s) >= max(host, copy):
                break
            host -= cost
            copy += self.copy_s
            moved += 1
        return moved


def _best(fn, device: torch.device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes a second from page-locked host memory (as the banks are, ``load_weights``) to ``device``."""
    payload = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(payload, device=device)
    return payload.numel() / _best(lambda: target.copy_(payload, non_blocking=True), device)


def probe_bank(experts: int, rows: int, k: int, dtype: torch.dtype, stored_format: str | None, pin: bool = True):
    """A host bank ``[experts, rows, k]`` for timing (in page-locked memory with ``pin``): the groupwise quantized
    ``stored_format``'s planes filled with arbitrary codes and small scales (wrapped as the host layer wraps a packed
    bank), else dense in ``dtype``."""
    spec = GROUPWISE.get(stored_format) if stored_format is not None else None
    if spec is None:
        return torch.empty((experts, rows, k), dtype=dtype, pin_memory=pin).fill_(0.01)
    gpr, n = spec.groups_per_row(k), experts * rows
    planes = (torch.empty((n, gpr * 32), dtype=torch.uint8, pin_memory=pin).fill_(0x5A),
              torch.empty((n, gpr * spec.high_bytes), dtype=torch.uint8, pin_memory=pin).fill_(0x5A),
              torch.empty((n, gpr), dtype=torch.float16, pin_memory=pin).fill_(1e-3))
    return DecodedBank(PackedWeight(stored_format, (experts, rows, k), planes))


def measure_expert_costs(hidden: int, inter: int, device: torch.device, dtype: torch.dtype,
                         threads: int | None = None, rows=None, stored_bytes: int | None = None,
                         stored_format: str | None = None) -> ExpertCosts | None:
    """:class:`ExpertCosts` for experts of ``hidden`` x ``inter`` on a ``device`` run in ``dtype``, the host
    computing with ``threads`` intra-op threads (None: torch's current count) and the pair kernel ``rows`` (None:
    torch's GEMMs); the experts stored in ``stored_format`` at ``stored_bytes`` an expert (None: dense in
    ``dtype``). None on the CPU (one memory: nothing to copy)."""
    if device.type == "cpu":
        return None
    size = torch.empty((), dtype=dtype).element_size()
    expert_bytes = 3 * inter * hidden * size
    copy_s = (stored_bytes or expert_bytes) / _copy_bandwidth(device)

    k = HOST_PROBE_EXPERTS
    experts = max(2 * k, HOST_PROBE_BYTES // (stored_bytes or expert_bytes) // k * k)
    gate_up = probe_bank(experts, 2 * inter, hidden, dtype, stored_format)
    down = probe_bank(experts, hidden, inter, dtype, stored_format)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        groups = iter(range(10**9))

        def call(tokens: int) -> None:   # the next k experts of the bank, every token routed to all of them
            first = next(groups) % (experts // k) * k
            ids = torch.arange(first, first + k).expand(tokens, k)
            routed_sum(torch.full((tokens, hidden), 0.01, dtype=dtype),
                                torch.full((tokens, k), 1.0 / k), ids, gate_up, down, rows=rows)

        call(1)   # first touch, thread team start
        one = _best(lambda: call(1), device, repeats=5) / k
        many_tokens = 16
        many = _best(lambda: call(many_tokens), device, repeats=3) / k
    finally:
        torch.set_num_threads(before)
    return ExpertCosts(copy_s=copy_s, host_s=one, host_token_s=max(many - one, 1e-9) / (many_tokens - 1))
