"""Op implementations and their resolution for one device type and dtype.

Invariants:
- An :class:`OpImpl` implements exactly one contract of :data:`ninfer.ops.contracts.CONTRACTS`.
- :func:`resolve_ops` picks, per op, the supporting implementation of highest priority; ties are an
  error (two plugins claiming the same slot). ``NINFER_OPS=reference`` forces the reference ops.
- An :class:`OpSet` is immutable once built; model code holds one and calls ``ops.<name>(...)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer.errors import NInferError
from ninfer.ops.contracts import CONTRACTS


class OpError(NInferError):
    """An op is unknown, unavailable for a device/dtype, or registered ambiguously."""


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op contract.

    ``devices``: device types it runs on ("cpu", "cuda"). ``dtypes``: activation dtypes it accepts
    (None = any). ``priority``: higher wins; the torch reference ops use 0, Triton kernels 10.
    """

    op: str
    name: str
    fn: Callable
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if self.op not in CONTRACTS:
            raise OpError(f"op implementation {self.name!r} targets unknown op {self.op!r}")

    def supports(self, device_type: str, dtype: torch.dtype) -> bool:
        return device_type in self.devices and (self.dtypes is None or dtype in self.dtypes)


class OpSet:
    """The chosen implementation of every available op for one (device type, dtype)."""

    def __init__(self, device_type: str, dtype: torch.dtype, chosen: dict[str, OpImpl]) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._chosen = dict(chosen)
        for name, impl in chosen.items():
            object.__setattr__(self, name, impl.fn)

    def __getattr__(self, name: str):  # only reached for ops that were not resolved
        if name in CONTRACTS:
            raise OpError(f"op {name!r} has no implementation for device {self.device_type!r} and "
                          f"dtype {self.dtype}; installed plugins provide none")
        raise AttributeError(name)

    def implementation(self, name: str) -> OpImpl:
        return self._chosen[name]

    def describe(self) -> dict[str, str]:
        return {name: impl.name for name, impl in sorted(self._chosen.items())}


def resolve_ops(impls: list[OpImpl], device_type: str, dtype: torch.dtype, *,
                force: str | None = None) -> OpSet:
    force = force if force is not None else os.environ.get("NINFER_OPS") or None
    chosen: dict[str, OpImpl] = {}
    for impl in impls:
        if not impl.supports(device_type, dtype):
            continue
        if force == "reference" and impl.priority != 0:
            continue
        best = chosen.get(impl.op)
        if best is None or impl.priority > best.priority:
            chosen[impl.op] = impl
        elif impl.priority == best.priority and impl.name != best.name:
            raise OpError(f"op {impl.op!r} has two implementations of priority {impl.priority} for "
                          f"{device_type}/{dtype}: {best.name!r} and {impl.name!r}")
    return OpSet(device_type, dtype, chosen)
