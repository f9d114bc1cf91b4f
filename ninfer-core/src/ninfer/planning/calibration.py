"""Graph calibration (docs/design.md section 7): the final KV capacity, decided after the decode graphs exist.

Startup (``ninfer.engine.model_construction.start_program``) builds the Program and captures its decode CUDA
graphs (CUDA only), then asks this module:

- :func:`runtime_free_bytes` measures what will stay free while serving: ``torch.cuda.mem_get_info``
  now, capped by what the budget leaves (``budget - held``, held = how much the device's free memory
  fell since the :class:`StartupProbe`; the same two caps as ``planning.budget.device_budget``), plus the
  stored weight originals the Program does not keep (:func:`released_weight_bytes`, freed when
  construction returns), minus the planned workspace (allocated by the first steps, not yet).
- :func:`calibrate_kv` (pure) decides: keep the pool when that keeps ``headroom`` free, else give up the deficit
  plus :func:`calibration_margin`: first from an expert cache the plan sized automatically (whole slots per layer;
  the plan places the KV for max_concurrency x max_context before it and fills the cache with what is left, so
  the cache is what yields), then from an automatic KV pool in whole pages, else fail (an explicit pool, or fewer
  pages than one max_context request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ninfer.planning.budget import BUDGET_WAYS, MIB, DeviceBudget, mib


@dataclass(frozen=True)
class KVCalibration:
    """What :func:`calibrate_kv` decided: ``action`` is ``"keep"`` (``num_pages`` unchanged),
    ``"shrink"`` (rebuild with ``num_pages`` and, unless None, ``cache_slots`` expert cache slots per layer) or
    ``"fail"`` (``reason`` says why and what to change)."""

    action: str
    num_pages: int
    reason: str = ""
    cache_slots: int | None = None


CALIBRATION_WAYS = (f"lower --max-context or --max-concurrency, {BUDGET_WAYS} / free device memory, or "
                    f"start without decode graphs (NINFER_CUDA_GRAPHS=0)")


def calibration_margin(deficit_bytes: int) -> int:
    """Extra bytes a corrective shrink frees beyond the measured deficit: the rebuild re-captures the
    same graphs, but allocator segments (2 MiB granularity) and what the first graphs left reserved may
    differ a little. 16 MiB, or 1/16 of a larger deficit."""
    return max(16 * MIB, deficit_bytes // 16)


def calibrate_kv(*, free_bytes: int, headroom_bytes: int, page_bytes: int, num_pages: int, min_pages: int,
                 shrinkable: bool = True, cache_slots: int = 0, slot_bytes: int = 0) -> KVCalibration:
    """The final KV capacity (and expert cache) after graph capture (pure; module docstring). ``free_bytes``: what
    stays free while serving with ``num_pages`` pages of ``page_bytes`` (:func:`runtime_free_bytes`);
    ``min_pages``: one max_context request; ``shrinkable``: the pool was sized automatically; ``cache_slots``:
    expert cache slots per layer the plan sized automatically (0: none, or set explicitly), each costing
    ``slot_bytes`` over all layers."""
    deficit = headroom_bytes - free_bytes
    if deficit <= 0:
        return KVCalibration("keep", num_pages)
    short = (f"{mib(free_bytes)} stays free after graph capture, {mib(deficit)} short of the "
             f"{mib(headroom_bytes)} headroom")
    need = deficit + calibration_margin(deficit)
    slots = cache_slots
    if cache_slots > 0 and slot_bytes > 0:
        drop_slots = min(cache_slots, -(-need // slot_bytes))
        slots, need = cache_slots - drop_slots, need - drop_slots * slot_bytes
        if need <= 0:
            return KVCalibration("shrink", num_pages, f"{short}: {drop_slots} of the {cache_slots} expert cache "
                                                      f"slots per layer give it up", cache_slots=slots)
    left = "" if slots == cache_slots else f"after all {cache_slots} expert cache slots per layer, "
    ways = CALIBRATION_WAYS
    if not shrinkable:
        return KVCalibration("fail", num_pages, f"{short}, {left}and the KV pool of {num_pages} pages was sized "
                                                f"explicitly; lower --num-pages / --kv-budget-mib, or {ways}")
    if page_bytes <= 0:
        return KVCalibration("fail", num_pages, f"{short}, {left}and the model has no KV pages to shrink; {ways}")
    drop = -(-need // page_bytes)
    pages = num_pages - drop
    if pages < min_pages:
        return KVCalibration("fail", num_pages, (
            f"{short}: {left}the KV pool would have to shrink by {drop} pages of {mib(page_bytes)} (deficit + "
            f"margin) from {num_pages} to {pages}, below the {min_pages} pages one max_context request "
            f"needs; {ways}"))
    return KVCalibration("shrink", pages, short if not left else f"{short}: {left}the KV pool gives up the rest",
                         cache_slots=None if slots == cache_slots else slots)


# -- measuring what startup left --------------------------------------------------------------------
def _storages(root: Any, device: torch.device | None = None) -> dict[tuple[str, int], int]:
    """The distinct storages of every tensor (on ``device``, where ``cuda`` without an index matches any
    CUDA device; None: any device) reachable from ``root`` through containers and NInfer objects:
    (device, data pointer) -> bytes."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            d = obj.device
            if device is None or (d.type == device.type and (device.index is None or d.index == device.index)):
                st = obj.untyped_storage()
                storages[(str(obj.device), st.data_ptr())] = st.nbytes()
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("ninfer"):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return storages


def tensor_storages(root: Any, device: torch.device | None = None) -> dict[tuple[str, int], int]:
    """The distinct storages reachable from ``root`` (as :func:`resident_tensor_bytes` finds them): (device, data
    pointer) -> bytes; ``device`` None: on any device."""
    return _storages(root, device)


def resident_tensor_bytes(root: Any) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``root`` through containers and
    NInfer objects (a view counts its whole storage once: that is what stays allocated)."""
    return sum(_storages(root).values())


def released_weight_bytes(weights: Any, program: Any, device: torch.device) -> int:
    """Bytes on ``device`` held by the loaded ``weights`` that ``program`` does not keep: the stored
    originals of converted weights (and loader parents no kept view shares), freed when construction
    drops the loaded weights."""
    kept = _storages(program, device)
    return sum(n for key, n in _storages(weights, device).items() if key not in kept)


def runtime_free_bytes(device: torch.device, budget: DeviceBudget, probe: StartupProbe, *, pending_bytes: int,
                       released_bytes: int) -> int:
    """What stays free while serving (CUDA; module docstring): the device's free memory now (after
    returning the allocator's unused cache), capped by ``budget - held`` (held: how much the free memory
    fell since ``probe``), plus ``released_bytes`` (freed when construction returns) minus
    ``pending_bytes`` (the planned workspace, allocated by the first steps)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    held = probe.free_bytes - free
    return min(free, budget.budget_bytes - held) + released_bytes - pending_bytes


class StartupProbe:
    """Started before the first large allocation; :meth:`retained_bytes` after construction. On CUDA it
    also records the device's free memory then (``free_bytes``), the base of :func:`runtime_free_bytes`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        self.free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0

    def retained_bytes(self, program: Any) -> int:
        """CUDA: growth of the caching allocator's reserved bytes (freed startup blocks it keeps count);
        CPU: the distinct storages of the Program's tensors (the host allocator returns the rest)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_reserved(self.device) - self._reserved
        return resident_tensor_bytes(program)
