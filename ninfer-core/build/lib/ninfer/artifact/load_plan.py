"""LoadPlan: the bound parameters with explicit placement and the bytes each device will hold.

:func:`resolve_load` fixes placement: every parameter gets one explicit device (``cpu`` or
``cuda:N``; a bare ``cuda`` becomes the current CUDA device, or ``cuda:0`` without CUDA); each
parent object appears once, with the set of devices that need it, so one bounded read serves all
of them. Nothing is read or allocated here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ninfer.artifact.binder import BoundParameter, BoundWeights
from ninfer.artifact.directory import ObjectRecord
from ninfer.artifact.errors import PlacementError


@dataclass(frozen=True)
class ParentLoad:
    """One parent object, read once and resident once on each of ``devices`` (cpu first)."""

    object: ObjectRecord
    dtype: torch.dtype
    devices: tuple[torch.device, ...]


@dataclass(frozen=True)
class ParameterLoad:
    """A parameter placed on ``device``: a view of its parent there, or a gathered copy."""

    parameter: BoundParameter
    device: torch.device

    @property
    def is_view(self) -> bool:
        return self.parameter.is_view


@dataclass(frozen=True)
class LoadPlan:
    """Resolved placement. Invariants: ``parents`` are unique and sorted by offset; every parent of
    every parameter is listed with that parameter's device; ``parent_bytes[d]`` is the parents'
    bytes on device ``d`` (each once), ``gathered_bytes[d]`` the bytes of gathered (non-view)
    parameters, and ``bytes_per_device[d]`` their sum, the peak a materialization allocates."""

    artifact_id: str
    parents: tuple[ParentLoad, ...]
    parameters: tuple[ParameterLoad, ...]
    parent_bytes: Mapping[str, int]
    gathered_bytes: Mapping[str, int]
    bytes_per_device: Mapping[str, int]


def normalize_device(device: str | torch.device) -> torch.device:
    """``cpu`` or ``cuda:N``; anything else is a :class:`PlacementError`."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PlacementError(f"cannot place weights on {device!r}: {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if dev.index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            return torch.device("cuda", index)
        return dev
    raise PlacementError(f"cannot place weights on {str(dev)!r}: only 'cpu' and 'cuda:N' are supported")


def resolve_load(bound: BoundWeights, device: str | torch.device, *,
                 placement: Mapping[str, str | torch.device] | None = None) -> LoadPlan:
    """Place every bound parameter on ``device``, or on ``placement[name]`` where given."""
    default = normalize_device(device)
    overrides = {name: normalize_device(d) for name, d in (placement or {}).items()}
    names = {bp.name for bp in bound.parameters}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise PlacementError(f"placement names parameters that are not bound: {', '.join(unknown)}")
    params: list[ParameterLoad] = []
    needs: dict[str, tuple[ObjectRecord, torch.dtype, set[torch.device]]] = {}
    gathered: dict[str, int] = {}
    for bp in bound.parameters:
        dev = overrides.get(bp.name, default)
        params.append(ParameterLoad(bp, dev))
        for piece in bp.pieces:
            entry = needs.setdefault(piece.object.id, (piece.object, bp.dtype, set()))
            entry[2].add(dev)
        if not bp.is_view:
            gathered[str(dev)] = gathered.get(str(dev), 0) + bp.nbytes
    parents: list[ParentLoad] = []
    parent_bytes: dict[str, int] = {}
    for obj, dtype, devs in sorted(needs.values(), key=lambda n: n[0].offset):
        ordered = tuple(sorted(devs, key=lambda d: (d.type != "cpu", d.index or 0)))
        parents.append(ParentLoad(obj, dtype, ordered))
        for d in ordered:
            parent_bytes[str(d)] = parent_bytes.get(str(d), 0) + obj.bytes
    total = {k: parent_bytes.get(k, 0) + gathered.get(k, 0) for k in sorted(set(parent_bytes) | set(gathered))}
    return LoadPlan(bound.artifact_id, tuple(parents), tuple(params), MappingProxyType(parent_bytes),
                    MappingProxyType(gathered), MappingProxyType(total))
