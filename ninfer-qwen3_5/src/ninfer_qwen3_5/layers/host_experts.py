"""Routed experts kept in host memory and computed by the CPU (``EngineOptions.host_experts``, docs/memory.md).

A MoE layer whose expert banks are host-placed runs its router, its shared expert and everything around it on
the run device as usual; only the routed experts' weighted sum is computed on the host:

1. the layer's normed hidden rows ``x[T, H]``, the routing weights and ids go to the host (one copy each, one
   wait for all three: the host waits for the device here, which is why lookahead is off with host experts, and
   why a captured decode graph is cut in segments here, :mod:`ninfer.program.host_steps`);
2. the CPU computes ``sum_j w[t, j] * expert_{ids[t, j]}(x_t)`` in fp32, tokens grouped by expert, in whatever
   format the bank is stored: :func:`~ninfer_qwen3_5.layers.host_compute.routed_sum`, with torch's CPU kernels
   (its intra-op thread team; a quantized bank decodes only the experts the step routes to) or the kernel
   ``host_expert_kernel`` names (the native one reads quantized banks as stored);
3. the fp32 sum goes back to the device, where the shared expert's fp32 term is added and the total is rounded
   once to the activation dtype.

With host calls (``host_calls``, on by default on a GPU: ``NINFER_HOST_CALLS``) a decode-sized call with the
native kernel and no cache runs the same three steps without Python and without cutting a captured graph:
through the layer's :class:`~ninfer_qwen3_5.layers.host_mailbox.HostMailbox`, the sum a host function on the
stream (:meth:`HostExperts._host_call`).

Invariant: without a cache, steps 2-3 are the reference ``moe_experts`` arithmetic split at its fp32 sum
(``routed_experts_fp32``, which ``routed_sum`` equals bitwise on the CPU, then ``shared_expert_fp32``), so on the
CPU a host-expert layer is bitwise the reference op's result, and on a GPU it differs from the device kernels only
by their summation order. With a device cache
(``expert_cache_slots``) the cached experts' pairs are summed on the device and rounded once to the activation
dtype before they join the fp32 sum: the same terms, one more rounding of a part of them. So are the pairs the
device reads over the bus (:meth:`HostExperts._bus_call`, the expert_costs module docstring).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch
from ninfer.errors import NotSupportedError
from ninfer.ops.contracts import SharedExpert
from ninfer.ops.reference.moe import shared_expert_fp32
from ninfer.ops.reference.quantized import DecodedBank
from ninfer.program.host_steps import host_step
from ninfer.quant import PackedWeight, QuantizationError

from ninfer_qwen3_5.layers.expert_cache import ExpertCache, device_bank, load_expert
from ninfer_qwen3_5.layers.expert_costs import ExpertCosts, IssueCosts
from ninfer_qwen3_5.layers.host_compute import expert_groups, routed_sum
from ninfer_qwen3_5.layers.host_mailbox import HostMailbox
from ninfer_qwen3_5.layers.host_native import NativeRows

_HOST = torch.device("cpu")


def _check_separable(name: str, bank: PackedWeight) -> None:
    """NotSupportedError unless every expert of ``bank`` is a view of its own (an nvfp4 bank whose experts do not
    fill whole 128-row scale tiles shares tiles between experts): host experts read, cache and copy one expert at a
    time."""
    try:
        for expert in range(bank.shape[0]):
            bank[expert]
    except QuantizationError as exc:
        raise NotSupportedError(f"host experts (--host-experts) need expert banks stored expert by expert; this "
                                f"{bank.format} {name} bank of shape {list(bank.shape)} is not: {exc}. Start without "
                                f"host experts, or convert the experts to another format") from None


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of ``tensors``: from a GPU, non-blocking copies into page-locked buffers and one wait for all
    of them (three blocking copies would wait three times per layer)."""
    out, ready = _copies_to_host(*tensors)
    if ready is not None:
        ready.synchronize()
    return out


def _copies_to_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """:func:`_to_host` without the wait: the host buffers and, from a GPU, the event after their copies (work
    queued after it does not delay them)."""
    if tensors[0].device.type != "cuda":
        return [t.to(_HOST) for t in tensors], None
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]   # torch's caching host pool
    for host, t in zip(out, tensors, strict=True):
        host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensors[0].device))
    return out, ready


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: to a GPU through page-locked memory without waiting (torch's caching host allocator keeps
    the buffer until the copy is done), so the host goes on queueing work."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


#: How fast a layer's measured host time corrects the cost model's host estimate (:attr:`HostExperts.host_scale`,
#: an exponential average of their ratio, each call's ratio clamped to [1/10, 10]).
ADAPT_RATE = 0.1
#: The most one measurement of the host's issue time (:class:`IssueCosts`) counts for, in multiples of the cost
#: model's one-expert time (host compute for a device call, copy for an expert's copies): enough to keep a small
#: call's pairs on the host, not so much that a compiling first call decides every later one.
ISSUE_CEILING = 10.0
_clock = time.perf_counter   # the host-time measurement's clock (tests replace it)


#: Routed pairs a host call's mailbox holds (its capacity in tokens: this over top-k): a decode step's, and few
#: enough that the native kernel sorts them itself (host_compute.SMALL_PAIRS and up).
MAILBOX_PAIRS = 256

#: The most routed pairs a call may have for bus reads (a decode step's: the device's GEMV path reads an expert once
#: a pair, so a call with many tokens an expert reads it many times over the bus).
BUS_PAIRS = 64

#: Experts staged on the device at once by the copy path (one ``moe_experts`` call per group of this many).
STAGE_SLOTS = 8


class ExpertStage:
    """The copy path's device buffers: ``slots`` experts like the host banks a layer passes to :meth:`buffers`, in
    ``dtype`` (or, for quantized banks, as they are stored), shared by every layer of a model (the layers run one
    after another; stream order keeps a layer's copies behind the previous one's kernels). Allocated at the first
    copy."""

    def __init__(self, device: torch.device, dtype: torch.dtype, slots: int = STAGE_SLOTS) -> None:
        self.device, self.dtype, self.slots = device, dtype, slots
        self._buffers: dict[str | None, tuple] = {}   # by the banks' stored format (None: dense)

    def buffers(self, gate_up, down) -> tuple:
        """The (gate_up, down) staging banks for the host banks ``gate_up`` / ``down``
        (:func:`~ninfer_qwen3_5.layers.expert_cache.device_bank`)."""
        key = gate_up.format if isinstance(gate_up, PackedWeight) else None
        if key not in self._buffers:
            self._buffers[key] = tuple(device_bank(b, self.slots, self.device, self.dtype) for b in (gate_up, down))
        return self._buffers[key]


class HostExperts:
    """One MoE layer's routed banks in host memory: ``gate_up[E, 2I, H]`` and ``down[E, H, I]`` (tensors or
    :class:`~ninfer.quant.PackedWeight`), both on the CPU. With ``cache_slots`` > 0 (and ``ops``, ``device``,
    ``dtype``), an :class:`~ninfer_qwen3_5.layers.expert_cache.ExpertCache` keeps that many of them on the device:
    the pairs routed to a cached expert are computed there by ``ops.moe_experts`` (its result rounded once to the
    activation dtype, then added to the fp32 sum). Uncached experts can be copied to a device staging buffer and
    their pairs computed there the same way, while the host computes the others: with ``copy_min_tokens`` N, those
    a call routes at least N tokens to; else with ``costs`` (:class:`ExpertCosts`), the busiest ones, as many as
    balances the copy engine against the host (with ``adapt_costs``, the host's costs corrected by the host time
    the layer measures). With ``costs`` that measured ``bus_s``, no cache and dense banks the device can read in
    place (page-locked, or one memory with the device), a call of few tokens instead has the device read the last
    :meth:`~ninfer_qwen3_5.layers.expert_costs.ExpertCosts.bus_ranks` choices of each token (fixed at the first
    call) over the bus, queued before the host waits for the routing (expert_costs module docstring), and neither
    copies nor caches. The rest run on the host, with ``threads`` intra-op threads (None: torch's count) set on
    the calling thread, by torch's GEMMs or, with ``rows``, the compiled pair kernel or the native kernel. With
    ``host_calls``, ``top_k`` (the router's) and the native kernel, no cache and fp32 or bf16 activations, calls of
    up to :data:`MAILBOX_PAIRS` pairs run as host calls (module docstring), bus reads beside them."""

    def __init__(self, gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight, *,
                 cache_slots: int = 0, ops=None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, copy_min_tokens: int | None = None,
                 costs: ExpertCosts | None = None, stage: ExpertStage | None = None,
                 threads: int | None = None, adapt_costs: bool = False, rows=None, host_calls: bool = False,
                 top_k: int | None = None) -> None:
        for name, bank in (("gate_up", gate_up), ("down", down)):
            if bank.device.type != "cpu":
                raise ValueError(f"host experts need their {name} bank in host memory, got one on {bank.device}")
            if isinstance(bank, PackedWeight):
                _check_separable(name, bank)
        # The banks as stored: the cache and the copy path move them so (a quantized one packed, for the device's
        # quantized op), the native kernel reads them so. For torch's GEMMs a quantized bank decodes only the
        # experts a step routes to, to fp32.
        self.stored = (gate_up, down)
        self.gate_up, self.down = (DecodedBank(b) if isinstance(b, PackedWeight) else b for b in (gate_up, down))
        self.ops, self.device, self.dtype = ops, device, dtype
        self.cache = ExpertCache(gate_up, down, cache_slots, device, dtype) if cache_slots else None
        if (copy_min_tokens is not None or costs is not None) and stage is None:
            raise ValueError("the copy path (copy_min_tokens or costs) needs an ExpertStage")
        self.copy_min_tokens, self.costs, self.stage, self.threads = copy_min_tokens, costs, stage, threads
        self.rows = rows   # host_compute.compiled_rows's kernel, a host_native.NativeRows, or None: torch's GEMMs
        # With adapt_costs, the measured over the estimated host time of this layer's host shares (module constant
        # ADAPT_RATE), by which the cost model scales its host costs.
        self.adapt_costs, self.host_scale = adapt_costs and costs is not None, 1.0
        # With adapt_costs, the host's measured seconds to queue the device's share (expert_costs.IssueCosts),
        # which the copy decision and the cached pairs' device-or-host choice count.
        self.issue = IssueCosts(rate=ADAPT_RATE)
        self.cached_on_host = 0   # cached pairs a call found cheaper to compute on the host, so far
        self._shared_down: tuple[PackedWeight, torch.Tensor] | None = None
        self.copied_experts = 0   # experts copied to the staging buffer so far
        self.bus_pairs = 0   # routed pairs the device computed reading host memory, so far
        self._bus_split: dict[int, int] = {}   # top-k -> the choices read over the bus (_bus_ranks)
        self._bus_skips: dict[tuple[int, int], torch.Tensor] = {}   # (T, k) -> the host's skip mask of a bus call
        # The device reads a bank in place only as it is: dense, contiguous, in the run dtype (its op would convert
        # or copy it otherwise) and page-locked (or in the device's own memory: the CPU).
        self._bus = (costs is not None and costs.bus_s is not None and self.cache is None and ops is not None
                     and all(isinstance(b, torch.Tensor) and b.is_contiguous() and (dtype is None or b.dtype == dtype)
                             and (device is None or device.type == "cpu" or b.is_pinned()) for b in self.stored))
        # With host_calls, decode-sized calls run as host functions on the stream, through this mailbox: with the
        # native kernel reading the banks as stored and no cache (whose admissions are the host's decisions).
        self.mailbox = None
        self._side: torch.cuda.Stream | None = None   # the bus reads' stream beside a host call's host function
        if (host_calls and top_k and device is not None and dtype in (torch.float32, torch.bfloat16)
                and self.cache is None and isinstance(rows, NativeRows) and NativeRows.supports(*self.stored)):
            self.mailbox = HostMailbox(*self.stored, top_k=top_k, capacity=max(1, MAILBOX_PAIRS // top_k),
                                       dtype=dtype, threads=threads or torch.get_num_threads(), device=device)
            if self._bus and device.type == "cuda":
                self._side = torch.cuda.Stream(device)
        # Wall seconds of each phase of the host step over all calls, when a profiler sets a dict here: "wait"
        # (the copies to the host, waiting for the device), "cache", "copy" (queueing the device's share: the
        # copy path and the cached experts' kernel), "host" (the CPU's sum) and "back" (queueing the sum's copy
        # back and the device parts' adds); "calls" counts them.
        self.phases: dict[str, float] | None = None

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 shared: SharedExpert | None) -> torch.Tensor:
        """``moe_experts(x, weights, ids, gate_up, down, shared=shared)`` with the routed part on the host (and
        the cached experts' pairs on the device); ``[T, H]`` in x.dtype on x's device. A host step of a captured
        forward (:func:`ninfer.program.host_steps.host_step`): in a CUDA graph it runs between two segments, and
        the shared expert's fp32 term before it and the sum's one rounding after it are captured in them."""
        term = self._shared_term(shared, x.dtype) if shared is not None else None
        if self.mailbox is not None and self.mailbox.fits(x, ids):
            return self._host_call(x, weights, ids, term)   # no host step: a captured graph stays whole
        routed = host_step(lambda: self._routed(x, weights, ids), (x.shape[0], x.shape[-1]), torch.float32,
                           x.device)
        if term is not None:
            routed = routed + term
        return routed.to(x.dtype)

    def _shared_term(self, shared: SharedExpert, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(shared.down, PackedWeight):   # decoded once: the layer passes the same weight each call
            if self._shared_down is None or self._shared_down[0] is not shared.down:
                self._shared_down = (shared.down, shared.down.dequantize(torch.float32))
            shared = replace(shared, down=self._shared_down[1])
        return shared_expert_fp32(shared, dtype)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed pairs' fp32 sum ``[T, H]`` on x's device: cached and copied experts' device sums (each
        rounded once to x.dtype) added to the host's."""
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)   # per calling thread (OpenMP): the engine worker's own team
        ranks = self._bus_ranks(ids.shape[1]) if self._bus and 0 < ids.numel() <= BUS_PAIRS else 0
        if ranks:
            return self._bus_call(x, weights, ids, ranks)
        t = self._lap(None, 0.0)
        x_h, w_h, ids_h = _to_host(x, weights, ids)
        t = self._lap("wait", t)
        parts: list[torch.Tensor] = []   # device sums, each rounded once to x.dtype
        cached = slot = None
        if self.cache is not None:
            self.cache.ready()   # the copies of the last call's refresh are in the slots
            cached, slot = self.cache.split(ids_h)
            self.cache.observe(ids_h)
            t = self._lap("cache", t)
        skip = cached
        estimate = 0.0   # the cost model's host time for this call, before host_scale
        if self.stage is not None:
            busy, estimate = self._busy(ids_h, cached)
            if busy and self.cache is not None:   # copied into the cache where it takes them, else staged
                admitted = self.cache.admit(busy, keep=set(ids_h[cached].tolist()))
                if admitted:
                    cached, slot = self.cache.split(ids_h, count=False)
                    busy = [e for e in busy if e not in set(admitted)]
                    self.copied_experts += len(admitted)
            skip = self._staged(x, w_h, ids_h, cached, busy, parts)
        if cached is not None and bool(cached.any()):
            host_cost = self._host_cost(ids_h[cached])
            if self.adapt_costs and self.issue.call_s is not None and host_cost < self.issue.call_s:
                skip = skip & ~cached   # one device call would cost the host more than computing these
                skip = skip if bool(skip.any()) else None
                estimate += host_cost
                self.cached_on_host += int(cached.sum())
            else:
                parts.append(self._on_device(x, w_h, cached, slot, self.cache.gate_up, self.cache.down))
        t = self._lap("copy", t)
        started = _clock()
        routed = routed_sum(x_h, w_h, ids_h, self.gate_up, self.down, skip=skip, rows=self.rows)
        if self.adapt_costs and estimate > 0:
            ratio = min(max((_clock() - started) / estimate, 0.1), 10.0)
            self.host_scale += ADAPT_RATE * (ratio - self.host_scale)
        elif self.adapt_costs and self.stage is not None:
            # Nothing measured (the copy path took every expert): drift back towards the start-up estimate, so
            # that a passing slowdown of the host does not keep it idle for good.
            self.host_scale += ADAPT_RATE * 0.1 * (1.0 - self.host_scale)
        t = self._lap("host", t)
        out = _to_device(routed, x.device)
        for part in parts:
            out += part.float()
        if self.cache is not None:   # the next call's cache, copied while the other layers run
            self.cache.refresh_behind()
        if self._lap("back", t):
            self.phases["calls"] = self.phases.get("calls", 0) + 1
        return out

    def _host_call(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   term: torch.Tensor | None) -> torch.Tensor:
        """The layer's output through the mailbox (host_mailbox module docstring). With bus reads the device computes
        the last choices of each token reading the banks over the bus, on a side stream forked after the mailbox's
        post and joined before its fetch, so that it runs while the host function computes the other choices."""
        box, k = self.mailbox, ids.shape[1]
        ranks = self._bus_ranks(k) if self._bus and ids.numel() <= BUS_PAIRS else 0
        if ranks == k:   # nothing for the host: as the host step's bus call
            self.bus_pairs += ids.shape[0] * k
            routed = self.ops.moe_experts(x, weights, ids, self.gate_up, self.down).float()
            return (routed + term if term is not None else routed).to(x.dtype)
        box.post(x, weights, ids, device_choices=ranks)
        if not ranks:
            box.run()
            return box.fetch(x.shape[0], term, x.dtype)
        main = torch.cuda.current_stream(x.device) if self._side is not None else None
        if main is not None:
            self._side.wait_stream(main)
        with torch.cuda.stream(self._side) if main is not None else contextlib.nullcontext():
            part = self.ops.moe_experts(x, weights[:, k - ranks:].contiguous(), ids[:, k - ranks:].contiguous(),
                                        self.gate_up, self.down)
        box.run()
        if main is not None:
            main.wait_stream(self._side)
        self.bus_pairs += ids.shape[0] * ranks
        return box.fetch(x.shape[0], term, x.dtype, part)

    def _bus_ranks(self, k: int) -> int:
        """The choices of each token read over the bus, from the start-up's costs, fixed at the first call: the
        device's kernels are compiled for that count (in the warm-up), and a count that followed the measured
        ``host_scale`` would compile new ones while serving."""
        if k not in self._bus_split:
            self._bus_split[k] = self.costs.bus_ranks(k)
        return self._bus_split[k]

    def _bus_call(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ranks: int) -> torch.Tensor:
        """:meth:`_routed` with the device reading the last ``ranks`` choices of each token in host memory: queued
        right behind the routing's copies to the host, so it runs while the host computes the other choices."""
        k = ids.shape[1]
        t = self._lap(None, 0.0)
        if ranks == k:   # nothing for the host: no copies, no wait
            part = self.ops.moe_experts(x, weights, ids, self.gate_up, self.down)
            self.bus_pairs += ids.shape[0] * k
            return part.float()
        (x_h, w_h, ids_h), ready = _copies_to_host(x, weights, ids)
        part = self.ops.moe_experts(x, weights[:, k - ranks:].contiguous(), ids[:, k - ranks:].contiguous(),
                                    self.gate_up, self.down)
        self.bus_pairs += ids.shape[0] * ranks
        t = self._lap("copy", t)
        if ready is not None:
            ready.synchronize()
        t = self._lap("wait", t)
        skip = self._bus_skips.get(tuple(ids_h.shape))
        if skip is None:   # one per batch size: the split is fixed
            skip = self._bus_skips[tuple(ids_h.shape)] = torch.zeros(ids_h.shape, dtype=torch.bool)
            skip[:, k - ranks:] = True
        routed = routed_sum(x_h, w_h, ids_h, self.gate_up, self.down, skip=skip, rows=self.rows)
        t = self._lap("host", t)
        out = _to_device(routed, x.device)
        out += part.float()
        if self._lap("back", t):
            self.phases["calls"] = self.phases.get("calls", 0) + 1
        return out

    def _lap(self, phase: str | None, since: float) -> float:
        """With :attr:`phases` set: adds the time since ``since`` to ``phase`` (None: only reads the clock) and
        returns the clock; else 0.0."""
        if self.phases is None:
            return 0.0
        now = time.perf_counter()
        if phase is not None:
            self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now

    def _on_device(self, x: torch.Tensor, w_h: torch.Tensor, mine: torch.Tensor, slot: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """``moe_experts`` over device banks for the pairs ``mine`` (bool ``[T, k]``) at bank rows ``slot``; the
        other pairs weigh zero (their slot is any valid row)."""
        started = _clock()
        out = self.ops.moe_experts(x, _to_device(w_h * mine, x.device), _to_device(slot, x.device), gate_up, down)
        if self.adapt_costs:
            self.issue.observe("call_s", _clock() - started, ISSUE_CEILING * self.costs.host_s)
        return out

    def _host_cost(self, ids: torch.Tensor) -> float:
        """The cost model's host seconds (times :attr:`host_scale`) for the routed expert ids ``ids``."""
        if self.costs is None or ids.numel() == 0:
            return 0.0
        counts = torch.bincount(ids.reshape(-1)).tolist()
        return self.host_scale * sum(self.costs.host_cost(n) for n in counts if n)

    def _busy(self, ids_h: torch.Tensor, cached: torch.Tensor | None) -> tuple[list[int], float]:
        """The uncached experts the copy path takes this call (class docstring), busiest first (ties: the lower
        expert id first), and the cost model's host time for the rest (before :attr:`host_scale`; 0.0 with a
        fixed threshold)."""
        _, groups = expert_groups(ids_h, cached, self.gate_up.shape[0])
        counted = sorted(groups, key=lambda ec: -ec[1])   # stable: ascending ids within a count
        if self.copy_min_tokens is not None:
            return [e for e, n in counted if n >= self.copy_min_tokens], 0.0
        moved = self.costs.copies([n for _, n in counted], self.host_scale, self.issue if self.adapt_costs else None)
        return [e for e, _ in counted[:moved]], sum(self.costs.host_cost(n) for _, n in counted[moved:])

    def _staged(self, x: torch.Tensor, w_h: torch.Tensor, ids_h: torch.Tensor, cached: torch.Tensor | None,
                busy: list[int], parts: list[torch.Tensor]) -> torch.Tensor | None:
        """Copies the ``busy`` experts to the staging buffer, a group at a time, and appends their pairs' device
        sums to ``parts``; returns the pairs computed on the device (``cached`` and theirs), None if none."""
        if not busy:
            return cached
        left = ids_h if cached is None else torch.where(cached, -1, ids_h)
        gu, dn = self.stage.buffers(*self.stored)
        skip = torch.zeros_like(ids_h, dtype=torch.bool) if cached is None else cached.clone()
        for at in range(0, len(busy), gu.shape[0]):
            group = busy[at:at + gu.shape[0]]
            row = torch.zeros(self.gate_up.shape[0], dtype=torch.int64)
            started = _clock()
            for i, e in enumerate(group):   # stream order keeps these behind the last group's kernels
                load_expert(gu, i, self.stored[0], e)
                load_expert(dn, i, self.stored[1], e)
                row[e] = i
            if self.adapt_costs:
                self.issue.observe("expert_s", (_clock() - started) / len(group), ISSUE_CEILING * self.costs.copy_s)
            mine = torch.isin(left, torch.tensor(group))
            parts.append(self._on_device(x, w_h, mine, row[ids_h], gu, dn))
            skip |= mine
            self.copied_experts += len(group)
        return skip
