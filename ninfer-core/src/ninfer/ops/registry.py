"""Op implementations and their resolution for one device type and dtype.

Invariants:
- An :class:`OpImpl` implements exactly one op contract, named by ``OpImpl.op``. Contracts come from plugins
  (``ninfer_op_contracts``), so an implementation is checked against them when ops are resolved, not when it is
  built: :func:`resolve_ops` rejects an implementation whose op no registered contract defines, naming the op
  and the plugin package it came from.
- :func:`resolve_ops` picks, per op, the supporting implementation of highest priority; ties are an
  error (two plugins claiming the same slot). ``NINFER_OPS=reference`` forces the reference ops.
- An :class:`OpSet` is immutable once built; model code holds one and calls ``ops.<name>(...)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from ninfer.errors import NInferError
from ninfer.ops.contracts import OpContract
from ninfer.plugins.registry import get_registry


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

    def origin(self) -> str:
        """Where the implementation comes from: the module defining ``fn`` (its top package is the plugin's)."""
        return getattr(self.fn, "__module__", None) or "an unknown module"

    def supports(self, device_type: str, dtype: torch.dtype) -> bool:
        return device_type in self.devices and (self.dtypes is None or dtype in self.dtypes)


class OpSet:
    """The chosen implementation of every available op for one (device type, dtype).

    ``contracts`` are the registered op contracts by name: asking for one of them that has no implementation
    here is an :class:`OpError` saying so; any other missing name is a plain ``AttributeError``.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, chosen: Mapping[str, OpImpl],
                 contracts: Mapping[str, OpContract]) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._chosen = dict(chosen)
        self._contracts = dict(contracts)
        for name, impl in chosen.items():
            object.__setattr__(self, name, impl.fn)

    def __getattr__(self, name: str):  # only reached for ops that were not resolved
        if name in self.__dict__.get("_contracts", ()):
            raise OpError(f"op {name!r} has no implementation for device {self.device_type!r} and "
                          f"dtype {self.dtype}; installed plugins provide none")
        raise AttributeError(name)

    def implementation(self, name: str) -> OpImpl:
        return self._chosen[name]

    def describe(self) -> dict[str, str]:
        return {name: impl.name for name, impl in sorted(self._chosen.items())}


def check_targets(impls: Iterable[OpImpl], contracts: Mapping[str, OpContract]) -> None:
    """:class:`OpError` for the first implementation whose op is not among ``contracts``."""
    for impl in impls:
        if impl.op not in contracts:
            origin = impl.origin()
            raise OpError(
                f"op implementation {impl.name!r} from plugin package {origin.split('.')[0]!r} ({origin}) targets "
                f"op {impl.op!r}, which no installed plugin defines: the plugin that owns {impl.op!r} registers its "
                f"contract through ninfer_op_contracts (defined: {', '.join(sorted(contracts)) or 'none'})")


def resolve_ops(impls: Iterable[OpImpl], device_type: str, dtype: torch.dtype, *,
                contracts: Mapping[str, OpContract] | None = None, force: str | None = None) -> OpSet:
    """The :class:`OpSet` of ``impls`` for ``(device_type, dtype)``, after checking every implementation against
    ``contracts`` (a registry's ``op_contracts``; None: those of the process-wide registry, ``get_registry()``).
    ``force="reference"`` (default: ``NINFER_OPS``) keeps only the priority-0 reference implementations."""
    impls = list(impls)
    contracts = get_registry().op_contracts if contracts is None else contracts
    check_targets(impls, contracts)
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
    return OpSet(device_type, dtype, chosen, contracts)
