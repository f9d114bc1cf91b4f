"""How a model's host experts are set up (``EngineOptions.host_experts``, docs/memory.md "Host experts"): the
keyword arguments every :class:`~ninfer_qwen3_5.layers.host_experts.HostExperts` of a model gets from its startup
features (host thread count, kernel, measured costs, the copy path's shared stage), the two switches of the
decode-sized paths (bus reads and host calls, each an environment variable) and the lookups a model makes over its
layers (caches, mailboxes, the kernel's name)."""

from __future__ import annotations

import logging

import torch
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.errors import NotSupportedError
from ninfer.switches import env_switch

from ninfer_qwen3_5.layers.expert_costs import measure_expert_costs
from ninfer_qwen3_5.layers.host_compute import compiled_rows
from ninfer_qwen3_5.layers.host_experts import STAGE_SLOTS, ExpertStage
from ninfer_qwen3_5.layers.host_mailbox import HostMailbox
from ninfer_qwen3_5.layers.host_native import NativeRows
from ninfer_qwen3_5.layers.host_threads import host_threads

log = logging.getLogger(__name__)

#: The environment variable that turns bus reads on ("1", the default) or off ("0") (:func:`bus_reads_enabled`).
BUS_READS_ENV = "NINFER_HOST_BUS_READS"
#: The environment variable that turns host calls on ("1", the default) or off ("0") (:func:`host_calls_enabled`).
HOST_CALLS_ENV = "NINFER_HOST_CALLS"


def bus_reads_enabled() -> bool:
    """Whether the cost model may send a decode step's pairs over the bus (:data:`BUS_READS_ENV`: "1", the
    default, or "0" for the copy path alone); an error naming the variable for another value (docs/memory.md, "Bus
    reads")."""
    return env_switch(BUS_READS_ENV, True, error=InvalidEngineOptions,
                      meaning="1: bus reads where the cost model finds them faster, 0: none")


def host_calls_enabled() -> bool:
    """Whether decode-sized calls go through a :class:`~ninfer_qwen3_5.layers.host_mailbox.HostMailbox` as host
    functions on the stream (:data:`HOST_CALLS_ENV`: "1", the default, or "0" for the eager host step); an error
    naming the variable for another value (docs/memory.md, "Host calls")."""
    return env_switch(HOST_CALLS_ENV, True, error=InvalidEngineOptions,
                      meaning="1: decode-sized calls as host functions on the stream, one graph a step, 0: the host "
                              "step between graph segments")


def host_expert_options(hidden: int, inter: int, experts: int, device: torch.device, dtype: torch.dtype,
                        features: StartupFeatures, stored: tuple[str, int] | None = None, ops=None) -> dict:
    """The host-expert keyword arguments of every :class:`~ninfer_qwen3_5.layers.moe.SparseMoE` of one model, from
    its ``features`` (``{}`` without host experts): ``expert_cache_slots`` per layer; the copy path's rule, a fixed
    token threshold ``expert_copy_min_tokens`` or else the :class:`~ninfer_qwen3_5.layers.expert_costs.ExpertCosts`
    measured once for the model (None on the CPU; ``stored``: the experts' quantized format and one expert's stored
    bytes, None if dense; with ``ops``, its ``moe_experts`` timed reading host banks over the bus for the bus reads);
    the one :class:`ExpertStage` all its layers share; the host's thread count
    (:func:`host_threads`); with ``host_expert_kernel`` "compiled", the host's pair kernel
    (:func:`~ninfer_qwen3_5.layers.host_compute.compiled_rows`, compiled here), with "native" NInfer's C kernel
    (:class:`~ninfer_qwen3_5.layers.host_native.NativeRows`, built here)."""
    if not features.host_experts:
        return {}
    copy_min = features.expert_copy_min_tokens
    threads = host_threads(device, features.host_expert_threads)
    kernel = features.host_expert_kernel
    if kernel == "auto":
        rows = _auto_rows(device, threads)
    else:
        rows = (compiled_rows(hidden, inter, dtype, threads) if kernel == "compiled"
                else NativeRows(threads) if kernel == "native" else None)
    fmt, nbytes = stored if stored is not None else (None, None)
    # A layer with a cache keeps its own device pairs and never reads over the bus: no need to time the bus.
    bus = getattr(ops, "moe_experts", None) if bus_reads_enabled() and not features.expert_cache_slots else None
    costs = (measure_expert_costs(hidden, inter, device, dtype, threads, rows, nbytes, fmt, bus=bus)
             if copy_min is None else None)
    if costs is not None:
        log.info("host experts: measured an expert's copy %.3f ms, host compute %.3f ms (+%.3f ms a further token), "
                 "a pair read over the bus %s", 1e3 * costs.copy_s, 1e3 * costs.host_s, 1e3 * costs.host_token_s,
                 "not measured" if costs.bus_s is None else f"{1e3 * costs.bus_s:.3f} ms")
    stage = (ExpertStage(device, dtype, min(STAGE_SLOTS, experts))
             if copy_min is not None or costs is not None else None)
    return dict(host_experts=True, cache_slots=features.expert_cache_slots, device=device, dtype=dtype,
                copy_min_tokens=copy_min, costs=costs, stage=stage, threads=threads, adapt_costs=costs is not None,
                rows=rows, host_calls=device.type == "cuda" and host_calls_enabled())


def _auto_rows(device: torch.device, threads: int | None):
    """``host_expert_kernel`` "auto": on a GPU run the native kernel (it reads each expert once and quantized banks
    as stored, which torch's GEMMs cannot), unless this host cannot build or load it, when torch's GEMMs compute
    instead and a warning says why; on the CPU torch's (bitwise the reference op)."""
    if device.type == "cpu":
        return None
    try:
        return NativeRows(threads)
    except NotSupportedError as exc:
        log.warning("host experts: the native kernel is not available, torch's GEMMs compute them instead (%s)", exc)
        return None


def kernel_name(options: dict) -> str | None:
    """The host kernel that :func:`host_expert_options`'s ``options`` compute with: "native", "compiled" or
    "torch" (None without host experts)."""
    if not options.get("host_experts"):
        return None
    rows = options.get("rows")
    return "native" if isinstance(rows, NativeRows) else "compiled" if rows is not None else "torch"


def expert_caches(moes) -> list:
    """The device caches of host experts of the MoE blocks ``moes`` (SparseMoE or None), in order."""
    hosts = (getattr(moe, "host", None) for moe in moes)
    return [h.cache for h in hosts if h is not None and h.cache is not None]


def host_mailboxes(moes) -> list[HostMailbox]:
    """The host-call mailboxes of the MoE blocks ``moes`` (SparseMoE or None), in order."""
    hosts = (getattr(moe, "host", None) for moe in moes)
    return [h.mailbox for h in hosts if h is not None and h.mailbox is not None]
