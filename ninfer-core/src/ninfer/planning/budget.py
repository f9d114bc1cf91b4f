"""The device budget (docs/design.md section 7): how many bytes a plan may use, and how many stay free.

- CUDA: the free memory ``torch.cuda.mem_get_info`` reports now, capped by ``NINFER_VRAM_BUDGET_MIB``
  when set; headroom ``CUDA_HEADROOM_BYTES`` (1 GiB, or ``NINFER_VRAM_HEADROOM_MIB`` when set, 0 allowed) is kept
  free on top of the plan: it covers what the plan does not model (kernel images, library workspaces,
  the allocator's fragmentation), which the start-up calibration measures after graph capture. The cap bounds the
  process's whole device footprint, the figure nvidia-smi shows: what the device already has in use when the
  plan is made (the CUDA context, this process's earlier allocations, and on a shared device other
  processes' memory too, so the cap is then conservative) is taken off it (``DeviceBudget.held_bytes``).
- CPU: ``NINFER_VRAM_BUDGET_MIB`` when set, else ``CPU_BUDGET_FRACTION`` of physical memory
  (``os.sysconf``): the host also carries the interpreter, tokenizer, server and other processes.
  Headroom is proportionate, ``CPU_HEADROOM_FRACTION`` of the budget, because host allocations outside
  the engine scale with the machine, not with a fixed driver reserve.
- Host memory of a CUDA run (:func:`host_budget`: parameters placed in host memory and the context cache's Host
  tier): the CPU rule without the device cap, ``NINFER_HOST_BUDGET_MIB`` when set, else ``CPU_BUDGET_FRACTION`` of
  physical memory, with the CPU headroom.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ninfer.contracts.options import InvalidEngineOptions
from ninfer.errors import NInferError

MIB = 1 << 20
GIB = 1 << 30
BUDGET_ENV = "NINFER_VRAM_BUDGET_MIB"
#: The ``env`` key the planner sets beside :data:`BUDGET_ENV` when the budget came from an option instead
#: (``--vram-budget-mib``): what the plan's messages name as its source.
BUDGET_SOURCE_KEY = "ninfer:vram_budget_source"
#: How the messages tell the user to change the device budget.
BUDGET_WAYS = f"raise --vram-budget-mib ({BUDGET_ENV})"
HOST_BUDGET_ENV = "NINFER_HOST_BUDGET_MIB"
HEADROOM_ENV = "NINFER_VRAM_HEADROOM_MIB"
CUDA_HEADROOM_BYTES = GIB
CPU_BUDGET_FRACTION = 0.5
CPU_HEADROOM_FRACTION = 0.1


class MemoryPlanError(NInferError):
    """The model, its KV/State and workspace cannot fit the device budget (the message has the numbers)."""


def mib(n: int) -> str:
    """``n`` bytes as the MiB figure every planning message uses."""
    return f"{n / MIB:,.1f} MiB"


@dataclass(frozen=True)
class DeviceBudget:
    """What a plan may use on ``device``: ``budget_bytes``, of which ``headroom_bytes`` stay free.
    ``source`` says where the figure came from (for messages and the MemorySummary). ``held_bytes``: what a
    capped CUDA budget already counted as in use before the plan (so the cap is ``budget_bytes + held_bytes``);
    0 otherwise."""

    device: str
    budget_bytes: int
    headroom_bytes: int
    source: str
    held_bytes: int = 0


def _env_mib(env: Mapping[str, str], name: str, *, zero_ok: bool) -> int | None:
    """The variable ``name`` as bytes (it holds MiB), None when unset or blank; an error naming it unless it is a
    positive number (or 0 too, with ``zero_ok``)."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero_ok else value > 0):
        raise InvalidEngineOptions(f"{name}={raw!r} must be " + ("a number of MiB, 0 or more" if zero_ok
                                                                 else "a positive number of MiB"))
    return int(value * MIB)


def _cuda_headroom(env: Mapping[str, str]) -> int:
    """``NINFER_VRAM_HEADROOM_MIB`` when set, else ``CUDA_HEADROOM_BYTES``."""
    headroom = _env_mib(env, HEADROOM_ENV, zero_ok=True)
    return CUDA_HEADROOM_BYTES if headroom is None else headroom


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_budget(device: torch.device, env: Mapping[str, str] | None = None) -> DeviceBudget:
    """The budget rule of the module docstring, read now (``env``: None reads ``os.environ``)."""
    env = os.environ if env is None else env
    capped = _env_mib(env, BUDGET_ENV, zero_ok=False)
    given = env.get(BUDGET_SOURCE_KEY, BUDGET_ENV)   # the option or the variable that set ``capped``
    if device.type == "cuda":
        headroom = _cuda_headroom(env)
        free, total = torch.cuda.mem_get_info(device)
        held = total - free
        if capped is not None and capped - held < free:
            return DeviceBudget(str(device), max(0, capped - held), headroom,
                                f"{given}={capped // MIB} less {mib(held)} already in use on the device "
                                f"(CUDA context included; CUDA free {mib(free)} of {mib(total)})", held)
        return DeviceBudget(str(device), int(free), headroom, f"CUDA free memory {mib(free)} of {mib(total)}")
    if device.type != "cpu":
        raise InvalidEngineOptions(f"no memory planning rule for device {device}")
    if capped is not None:
        budget, source = capped, f"{given}={capped // MIB}"
    else:
        phys = physical_memory_bytes()
        budget, source = int(phys * CPU_BUDGET_FRACTION), f"{CPU_BUDGET_FRACTION:g} x physical {mib(phys)}"
    return DeviceBudget("cpu", budget, int(budget * CPU_HEADROOM_FRACTION), source)


def host_budget(env: Mapping[str, str] | None = None) -> DeviceBudget:
    """The host memory a CUDA run may use for host-placed weights and the Host tier (module docstring)."""
    env = os.environ if env is None else env
    capped = _env_mib(env, HOST_BUDGET_ENV, zero_ok=False)
    if capped is not None:
        budget, source = capped, f"{HOST_BUDGET_ENV}={capped // MIB}"
    else:
        phys = physical_memory_bytes()
        budget, source = int(phys * CPU_BUDGET_FRACTION), f"{CPU_BUDGET_FRACTION:g} x physical {mib(phys)}"
    return DeviceBudget("host", budget, int(budget * CPU_HEADROOM_FRACTION), source)
