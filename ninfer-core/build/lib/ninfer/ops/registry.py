"""Op implementations and their resolution for one device type and dtype.

Invariants:
- An :class:`OpImpl` implements exactly one op contract, named by ``OpImpl.op``. Contracts come from plugins
  (``ninfer_op_contracts``), so an implementation is checked against them when ops are resolved, not when it is
  built: :func:`resolve_ops` rejects an implementation whose op no registered contract defines, naming the op
  and the plugin package it came from.
- :func:`resolve_ops` picks, per op, the supporting implementation of highest priority; ties are an
  error (two plugins claiming the same slot). ``NINFER_OPS=reference`` forces the reference ops.
- The stored weight format is part of the key: an implementation serves dense (raw float tensor) weights
  (``weight_formats`` None) or the quantized formats it names. An op with quantized implementations is
  called through a dispatcher that routes a call whose arguments hold a
  :class:`~ninfer.quant.PackedWeight` to the implementation for that weight's format (an :class:`OpError`
  naming op, format and device when there is none), so a packed weight never reaches a dense op.
  :meth:`OpSet.check_formats` lets a model refuse, at construction, weight formats a device cannot run.
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
from ninfer.quant import PackedWeight


class OpError(NInferError):
    """An op is unknown, unavailable for a device/dtype, or registered ambiguously."""


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op contract.

    ``devices``: device types it runs on ("cpu", "cuda"). ``dtypes``: activation dtypes it accepts
    (None = any). ``priority``: higher wins; the torch reference ops use 0, Triton kernels 10.
    ``weight_formats``: the quantized stored formats whose packed weights it takes (None: dense weights).
    """

    op: str
    name: str
    fn: Callable
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] | None = None
    priority: int = 0
    weight_formats: frozenset[str] | None = None

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
                 contracts: Mapping[str, OpContract],
                 by_format: Mapping[str, Mapping[str, OpImpl]] | None = None) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._chosen = dict(chosen)
        self._contracts = dict(contracts)
        self._by_format = {op: dict(m) for op, m in (by_format or {}).items() if m}
        for name, impl in chosen.items():
            object.__setattr__(self, name, impl.fn)
        for name, impls in self._by_format.items():
            object.__setattr__(self, name, self._dispatcher(name, chosen.get(name), impls))

    def _dispatcher(self, op: str, dense: OpImpl | None, impls: Mapping[str, OpImpl]) -> Callable:
        def call(*args, **kwargs):
            fmt = _packed_format(args, kwargs)
            impl = dense if fmt is None else impls.get(fmt)
            if impl is None:
                raise OpError(self._missing(op, fmt or "dense"))
            return impl.fn(*args, **kwargs)
        call.__name__ = op
        return call

    def _missing(self, op: str, fmt: str) -> str:
        have = ", ".join(sorted(self._by_format.get(op, {}))) or "none"
        return (f"op {op!r} has no implementation for {fmt} weights on device {self.device_type!r} "
                f"(dtype {self.dtype}); quantized formats it runs here: {have}")

    def check_formats(self, op: str, formats) -> None:
        """:class:`OpError` naming the first quantized weight format in ``formats`` that ``op`` cannot take here."""
        for fmt in formats:
            if fmt not in self._by_format.get(op, {}):
                raise OpError(self._missing(op, fmt))

    def __getattr__(self, name: str):  # only reached for ops that were not resolved
        if name in self.__dict__.get("_contracts", ()):
            raise OpError(f"op {name!r} has no implementation for device {self.device_type!r} and "
                          f"dtype {self.dtype}; installed plugins provide none")
        raise AttributeError(name)

    def implementation(self, name: str, weight_format: str | None = None) -> OpImpl:
        if weight_format is not None:
            return self._by_format[name][weight_format]
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
    chosen: dict[tuple[str, str | None], OpImpl] = {}
    for impl in impls:
        if not impl.supports(device_type, dtype):
            continue
        if force == "reference" and impl.priority != 0:
            continue
        for fmt in (sorted(impl.weight_formats) if impl.weight_formats is not None else (None,)):
            key = (impl.op, fmt)
            best = chosen.get(key)
            if best is None or impl.priority > best.priority:
                chosen[key] = impl
            elif impl.priority == best.priority and impl.name != best.name:
                what = "" if fmt is None else f" ({fmt} weights)"
                raise OpError(f"op {impl.op!r}{what} has two implementations of priority {impl.priority} for "
                              f"{device_type}/{dtype}: {best.name!r} and {impl.name!r}")
    dense = {op: impl for (op, fmt), impl in chosen.items() if fmt is None}
    by_format: dict[str, dict[str, OpImpl]] = {}
    for (op, fmt), impl in chosen.items():
        if fmt is not None:
            by_format.setdefault(op, {})[fmt] = impl
    return OpSet(device_type, dtype, dense, contracts, by_format)


def _packed_format(args: tuple, kwargs: Mapping) -> str | None:
    """The format of the first packed weight among the arguments (one dataclass level deep), else None."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, PackedWeight):
            return value.format
        fields = getattr(value, "__dataclass_fields__", None)
        if fields:
            for name in fields:
                inner = getattr(value, name)
                if isinstance(inner, PackedWeight):
                    return inner.format
    return None
