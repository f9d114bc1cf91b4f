"""The measured costs of a host expert on a GPU run, and the per-call choice they drive: copy or compute.

A routed expert that is not cached on the device can be computed by the host's CPU (reading its weights from host
memory) or copied over the bus to a staging buffer and computed by the device. The two run at the same time: the
copies are queued on the device's stream before the host starts its share. So a layer call gives the copy engine
the busiest uncached experts (a copy costs the same whatever the token count; host compute grows with it) until
the two sides are about even: :meth:`ExpertCosts.copies` balances their estimated finishing times. A layer then
corrects the host's side by the host time it measures (``HostExperts.host_scale``): the start-up timing runs
alone, a layer's host share runs in the engine's thread among the device's work.

Queueing the device's share is not free either: the same host thread first issues the copies and the device
op's launches (eager, between two graph segments), and only then computes its own share, so that issue time
delays both sides. At one token per expert it can exceed what moving an expert saves the host. A layer measures
it as it goes (:class:`IssueCosts`: the host seconds of one device call and of one expert's copies), and the
balance counts it, so a call copies only where the copies still pay after their issue; the same measure decides
whether a call's cached pairs are worth a device call or cheaper on the host, which holds every expert too.

:func:`measure_expert_costs` measures the constants once per model at start (about half a second):

- ``copy_s``: one expert's stored bytes (``3 * inter * hidden`` weights in the run dtype, or what a quantized
  expert takes) over the pinned host-to-device bandwidth;
- ``host_s`` / ``host_token_s``: the host computing one expert for one routed token, and each further token. A
  single-token expert is bound by reading its weights from memory (a GEMV), so this is timed on a bank larger than
  the CPU's caches, with the host thread count the layer will run with, through the same function the layer uses,
  on a bank stored as the model's is (a groupwise quantized format's planes filled with arbitrary codes, which the
  kernels' time does not depend on; dense in the run dtype otherwise);
- ``bus_s`` (dense page-locked banks only): the device computing one routed pair by reading its expert's weights
  in place in host memory over the bus (unified addressing), with the device's own ``moe_experts``.

Bus reads are the third way, for the few tokens of a decode step: the device's share is queued before the host's
wait for the step's routing (so it costs no copy calls and no routing round trip) and reads the last
:meth:`ExpertCosts.bus_ranks` choices of every token while the host computes the others. Both read host memory;
the bus's reads go through the memory controller, not the CPU's cores, so the two shares should add up
(``tools/bus_reads_bench.py`` measures whether they do).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from ninfer.ops.reference.quantized import DecodedBank
from ninfer.quant import PackedWeight
from ninfer.quant.groupwise import GROUPWISE

from ninfer_qwen3_5.layers.host_compute import routed_sum

log = logging.getLogger(__name__)

#: Bytes of expert weights the host timing cycles through: more than a server CPU's last-level cache, so the
#: timing reads from memory as a layer call does.
HOST_PROBE_BYTES = 512 << 20
#: Experts per timed host call (a decode step's top-k is about this many).
HOST_PROBE_EXPERTS = 8


@dataclass(frozen=True)
class ExpertCosts:
    """Seconds, measured at start: ``copy_s`` to copy one expert to the device; ``host_s`` for the host to compute
    one expert for one token; ``host_token_s`` for each further token routed to it; ``bus_s`` for the device to
    compute one routed pair reading its expert in host memory (None: not measured, no bus reads). Invariant: all
    that are given > 0."""

    copy_s: float
    host_s: float
    host_token_s: float
    bus_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.copy_s > 0 and self.host_s > 0 and self.host_token_s > 0
                and (self.bus_s is None or self.bus_s > 0)):
            raise ValueError(f"expert costs must be > 0, got {self}")

    def bus_ranks(self, k: int) -> int:
        """How many of each token's ``k`` choices (the last ones) the device reads over the bus: the count whose
        later side finishes first, the bus's ``d`` pairs a token against the host's ``k - d`` (each counted as a
        distinct expert, as a decode step's pairs mostly are, so the token count scales both sides alike); the
        fewer on a tie. 0 without ``bus_s``."""
        if self.bus_s is None:
            return 0
        best, ranks = math.inf, 0
        for d in range(k + 1):
            finish = max(d * self.bus_s, (k - d) * self.host_s)
            if finish < best:
                best, ranks = finish, d
        return ranks

    def host_cost(self, tokens: int) -> float:
        return self.host_s + (tokens - 1) * self.host_token_s

    def copies(self, counts: list[int], host_scale: float = 1.0, issue: IssueCosts | None = None) -> int:
        """How many of the uncached experts with token ``counts`` (sorted descending) to copy, the busiest
        first: the fewest that give the earliest finish of the later of the two sides (they run concurrently),
        the host's side being its issue of the copies and the device call (``issue``, what the layer measured;
        None: free) and then its compute of the rest. ``host_scale`` multiplies the host's costs (what the layer
        has measured its host time to be, against this estimate)."""
        rest = host_scale * sum(self.host_cost(n) for n in counts)
        best, moved = rest, 0
        for m, n in enumerate(counts, 1):
            rest -= host_scale * self.host_cost(n)
            queued = issue.of(m) if issue is not None else 0.0
            finish = queued + max(rest, m * self.copy_s)
            if finish < best:
                best, moved = finish, m
        return moved


@dataclass
class IssueCosts:
    """What queueing the device's share of a layer call costs the host, in seconds, as one layer measures it (an
    exponential average at ``rate``, its first measurement taken whole; None until measured, which counts as
    free): ``call_s`` one device call of a group of pairs (their routing copied to the device and the op's
    launches), ``expert_s`` the copies of one expert's banks to the staging buffer. Owned and updated by the layer
    that measures them, on the engine's worker thread."""

    call_s: float | None = None
    expert_s: float | None = None
    rate: float = 0.1

    def of(self, experts: int) -> float:
        """The host's seconds to queue ``experts`` copied experts and their device call (0 for none)."""
        if experts == 0:
            return 0.0
        return (self.call_s or 0.0) + experts * (self.expert_s or 0.0)

    def observe(self, what: str, seconds: float, ceiling: float = math.inf) -> None:
        """Folds one measurement of ``what`` ("call_s" or "expert_s") in, clamped to ``ceiling``: a first call that
        compiles its kernels would otherwise stand as the estimate, and an estimate that keeps the work on the host
        makes no device call that could correct it."""
        seconds = min(seconds, ceiling)
        old = getattr(self, what)
        setattr(self, what, seconds if old is None else old + self.rate * (seconds - old))


def _best(fn, device: torch.device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def host_to_device_bandwidth(device: torch.device) -> float:
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
                         stored_format: str | None = None, bus=None) -> ExpertCosts | None:
    """:class:`ExpertCosts` for experts of ``hidden`` x ``inter`` on a ``device`` run in ``dtype``, the host
    computing with ``threads`` intra-op threads (None: torch's current count) and the pair kernel ``rows`` (None:
    torch's GEMMs); the experts stored in ``stored_format`` at ``stored_bytes`` an expert (None: dense in
    ``dtype``); ``bus``: the device's ``moe_experts``, timed on page-locked dense banks for ``bus_s`` (None, or
    a quantized format: no bus reads). None on the CPU (one memory: nothing to copy)."""
    if device.type == "cpu":
        return None
    size = torch.empty((), dtype=dtype).element_size()
    expert_bytes = 3 * inter * hidden * size
    copy_s = (stored_bytes or expert_bytes) / host_to_device_bandwidth(device)

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
    bus_s = None
    if bus is not None and stored_format is None:
        try:
            bus_s = _bus_seconds(bus, gate_up, down, device, dtype)
        except ValueError as exc:   # Triton's refusal of a pointer the device cannot read: copies remain
            log.warning("host experts: the device could not read experts in host memory (%s: %s); no bus reads",
                        type(exc).__name__, str(exc)[:300])
    return ExpertCosts(copy_s=copy_s, host_s=one, host_token_s=max(many - one, 1e-9) / (many_tokens - 1),
                       bus_s=bus_s)


def _bus_seconds(bus, gate_up: torch.Tensor, down: torch.Tensor, device: torch.device,
                 dtype: torch.dtype) -> float:
    """Seconds for ``bus`` (``moe_experts``) to compute one token's pair reading its expert in place in the
    page-locked banks ``gate_up`` / ``down``: one token routed to the next :data:`HOST_PROBE_EXPERTS` experts of
    the bank (more bytes than the device's cache holds, as in a decode step), per pair."""
    k, experts = HOST_PROBE_EXPERTS, gate_up.shape[0]
    x = torch.full((1, gate_up.shape[-1]), 0.01, dtype=dtype, device=device)
    w = torch.full((1, k), 1.0 / k, device=device)
    ids = [torch.arange(first, first + k, device=device)[None] for first in range(0, experts - k + 1, k)]
    turn = iter(range(10**9))

    def call() -> None:
        bus(x, w, ids[next(turn) % len(ids)], gate_up, down)

    call()   # compiles the kernels
    return _best(call, device, repeats=5) / k
