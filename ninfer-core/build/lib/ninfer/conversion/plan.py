"""Checking a plugin's :class:`ConversionPlan` against the source tensors before any byte is written.

:func:`check_plan` enforces the invariants stated in :mod:`ninfer.artifact.source_mapping` and
resolves each planned object to its stored shape and format. A plan that passes yields a
:class:`CheckedPlan` whose invariants the converter relies on:

- component ids are unique, ``text`` is one of them, every ``target`` names another component and
  every component config is a JSON object with a non-empty ``architectures`` list;
- every source tensor is consumed by exactly one object or listed in ``ignored`` (never both); a tensor
  consumed as :class:`SourceRows` ranges has rank >= 1, and its ranges, all in that one object, are
  non-empty, in bounds and cover its rows exactly once;
- an object's sources share dtype and trailing dims and have rank >= 1 when there are several or when one
  is a row range;
  the object's shape is theirs concatenated along dim 0, with 1..16 positive dims;
- the object's format is a storage format, reached from the source dtype either unchanged
  (``cast`` False: stored bytes = source bytes) or by a supported cast (``cast`` True);
- binding names are unique, each binding is exactly one whole object or a non-empty list of
  non-empty in-bounds element ranges of planned objects;
- every use names a binding, (parameter, input) pairs are unique and policies are known.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ninfer.artifact.format import FORMATS, MAX_RANK, RAW_FORMATS, encoded_size
from ninfer.artifact.source_mapping import (
    BindingPlan,
    ConversionPlan,
    ObjectPlan,
    SourceRows,
    SourceTensor,
    source_name,
)
from ninfer.conversion.cast import cast_supported
from ninfer.conversion.errors import PlanError

# Storage format of a value-preserving import, by safetensors dtype.
PRESERVED_FORMAT: Mapping[str, str] = MappingProxyType(
    {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "I32": "int32"})
# Storage formats the converter writes: the loadable raw-word formats of the V3 table.
FORMAT_ITEMSIZE: Mapping[str, int] = MappingProxyType(
    {name: FORMATS[name].element_bytes for name in RAW_FORMATS})
ACTIVATION_POLICIES = frozenset({"A16Only", "AllowA8", "AllowA4"})


@dataclass(frozen=True)
class CheckedObject:
    """A planned object resolved against the sources: stored ``shape`` and ``format``, the common
    source ``dtype``, and whether the import ``cast``s (changes values) or copies bytes."""

    id: str
    component: str
    sources: tuple[str | SourceRows, ...]
    shape: tuple[int, ...]
    dtype: str
    format: str
    cast: bool

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return encoded_size(self.format, self.layout, self.shape, object_id=self.id)

    @property
    def layout(self) -> str:
        return FORMATS[self.format].layouts[0]

    @property
    def quantized(self) -> bool:
        return FORMATS[self.format].quantized


@dataclass(frozen=True)
class CheckedPlan:
    """A plan that satisfies every invariant of this module, with objects in plan order."""

    plan: ConversionPlan
    objects: tuple[CheckedObject, ...]

    @property
    def casts(self) -> tuple[CheckedObject, ...]:
        return tuple(o for o in self.objects if o.cast)


def check_plan(plan: ConversionPlan, tensors: Mapping[str, SourceTensor]) -> CheckedPlan:
    """Validate ``plan`` against the source ``tensors``; raise :class:`PlanError` naming the fault."""
    if not isinstance(plan, ConversionPlan):
        raise PlanError(f"the source mapping returned {type(plan).__name__}, not a ConversionPlan")
    components = _check_components(plan)
    _check_coverage(plan, tensors)
    objects = tuple(_resolve_object(o, components, tensors) for o in plan.objects)
    _check_bindings(plan, {o.id: o for o in objects})
    return CheckedPlan(plan, objects)


def _claim_name(kind: str, field: str, name: object, taken: set[str]) -> None:
    """Components, objects and bindings are each named by a non-empty string unique among their kind."""
    if not isinstance(name, str) or not name:
        raise PlanError(f"{field} {name!r} is not a non-empty string")
    if name in taken:
        raise PlanError(f"{kind} {name!r} is planned twice")
    taken.add(name)


def _check_components(plan: ConversionPlan) -> set[str]:
    ids: set[str] = set()
    for c in plan.components:
        _claim_name("component", "component id", c.id, ids)
        if not isinstance(c.config, Mapping):
            raise PlanError(f"component {c.id!r}: config is not a mapping")
        archs = c.config.get("architectures")
        if not isinstance(archs, (list, tuple)) or not archs or not all(isinstance(a, str) and a for a in archs):
            raise PlanError(f"component {c.id!r}: config has no non-empty 'architectures' list")
    if "text" not in ids:
        raise PlanError(f"the plan has no 'text' component (components: {sorted(ids)}); an artifact "
                        f"without text cannot be loaded")
    for c in plan.components:
        if c.target is not None and (c.target not in ids or c.target == c.id):
            raise PlanError(f"component {c.id!r} targets {c.target!r}, which is not another planned component")
    return ids


def _check_coverage(plan: ConversionPlan, tensors: Mapping[str, SourceTensor]) -> None:
    consumer: dict[str, str] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    object_ids: set[str] = set()
    for o in plan.objects:
        _claim_name("object", "object id", o.id, object_ids)
        if not o.sources:
            raise PlanError(f"object {o.id!r} has no source tensors")
        mine: set[str] = set()
        for src in o.sources:
            name = source_name(src)
            if name not in tensors:
                raise PlanError(f"object {o.id!r} reads source tensor {name!r}, which the checkpoint does not have")
            if isinstance(src, SourceRows):
                _check_rows(o.id, src, tensors[name])
                if name in consumer and consumer[name] != o.id:
                    raise PlanError(f"source tensor {name!r} is consumed by both object {consumer[name]!r} "
                                    f"and object {o.id!r}")
                if name in mine and name not in ranges:
                    raise PlanError(f"object {o.id!r} reads source tensor {name!r} both whole and as row ranges")
                ranges.setdefault(name, []).append((src.begin, src.end))
            elif name in mine:
                raise PlanError(f"object {o.id!r} reads source tensor {name!r} more than once (whole, or whole and "
                                f"as row ranges)")
            elif name in consumer:
                raise PlanError(f"source tensor {name!r} is consumed by both object {consumer[name]!r} "
                                f"and object {o.id!r}")
            consumer[name] = o.id
            mine.add(name)
    for name, spans in ranges.items():
        _check_partition(consumer[name], name, sorted(spans), tensors[name].shape[0])
    for name in plan.ignored:
        if name not in tensors:
            raise PlanError(f"the plan ignores source tensor {name!r}, which the checkpoint does not have")
        if name in consumer:
            raise PlanError(f"source tensor {name!r} is both ignored and consumed by object {consumer[name]!r}")
    unmapped = [name for name in tensors if name not in consumer and name not in plan.ignored]
    if unmapped:
        shown = ", ".join(repr(n) for n in unmapped[:8])
        more = f" and {len(unmapped) - 8} more" if len(unmapped) > 8 else ""
        raise PlanError(f"source tensor {shown}{more} is neither converted nor ignored by the plan; "
                        f"the source mapping does not know it")


def _check_rows(oid: str, src: SourceRows, tensor: SourceTensor) -> None:
    if len(tensor.shape) == 0:
        raise PlanError(f"object {oid!r} reads rows of source tensor {src.name!r}, which is a scalar")
    ok = all(type(v) is int for v in (src.begin, src.end)) and 0 <= src.begin < src.end <= tensor.shape[0]
    if not ok:
        raise PlanError(f"object {oid!r} reads rows [{src.begin!r}, {src.end!r}) of source tensor {src.name!r}, "
                        f"which has {tensor.shape[0]} rows")


def _check_partition(oid: str, name: str, spans: list[tuple[int, int]], rows: int) -> None:
    """Row ranges of one tensor must tile ``[0, rows)``: a reorder, never a duplicate or a dropped row."""
    at = 0
    for begin, end in spans:
        if begin != at:
            what = "overlap" if begin < at else "leave a gap"
            raise PlanError(f"object {oid!r}: the row ranges of source tensor {name!r} {what} at row "
                            f"{min(begin, at)} (they must cover its {rows} rows exactly once)")
        at = end
    if at != rows:
        raise PlanError(f"object {oid!r}: the row ranges of source tensor {name!r} stop at row {at} of {rows} "
                        f"(they must cover its rows exactly once)")


def _source_rows(src: str | SourceRows, tensors: Mapping[str, SourceTensor]) -> int:
    t = tensors[source_name(src)]
    if isinstance(src, SourceRows):
        return src.end - src.begin
    return t.shape[0] if t.shape else 1


def _resolve_object(o: ObjectPlan, components: set[str], tensors: Mapping[str, SourceTensor]) -> CheckedObject:
    if o.component not in components:
        raise PlanError(f"object {o.id!r} belongs to component {o.component!r}, which is not planned")
    first = tensors[source_name(o.sources[0])]
    for src in o.sources[1:]:
        t = tensors[source_name(src)]
        if t.dtype != first.dtype:
            raise PlanError(f"object {o.id!r}: source {t.name!r} has dtype {t.dtype}, but {first.name!r} "
                            f"has {first.dtype}; fused sources must share a dtype")
        if len(t.shape) == 0 or len(first.shape) == 0 or t.shape[1:] != first.shape[1:]:
            raise PlanError(f"object {o.id!r}: source {t.name!r} has shape {list(t.shape)}, which cannot be "
                            f"concatenated along dim 0 with {first.name!r} of shape {list(first.shape)}")
    whole = len(o.sources) == 1 and not isinstance(o.sources[0], SourceRows)
    shape = first.shape if whole else (sum(_source_rows(s, tensors) for s in o.sources), *first.shape[1:])
    if len(shape) > MAX_RANK or any(d <= 0 for d in shape):
        raise PlanError(f"object {o.id!r} would have shape {list(shape)}; stored objects need 0..{MAX_RANK} "
                        f"positive dims (ignore empty tensors in the plan)")

    preserved = PRESERVED_FORMAT.get(first.dtype)
    if o.format is None:
        if preserved is None:
            raise PlanError(f"object {o.id!r}: source dtype {first.dtype} of {first.name!r} has no storage "
                            f"format (value-preserving import supports {', '.join(PRESERVED_FORMAT)})")
        return CheckedObject(o.id, o.component, tuple(o.sources), tuple(shape), first.dtype, preserved, False)
    if o.format not in FORMAT_ITEMSIZE:
        raise PlanError(f"object {o.id!r}: format {o.format!r} is not one of {', '.join(FORMAT_ITEMSIZE)}")
    if o.format == preserved:
        return CheckedObject(o.id, o.component, tuple(o.sources), tuple(shape), first.dtype, o.format, False)
    if not cast_supported(first.dtype, o.format):
        raise PlanError(f"object {o.id!r}: casting source dtype {first.dtype} to {o.format} is not supported")
    return CheckedObject(o.id, o.component, tuple(o.sources), tuple(shape), first.dtype, o.format, True)


def _check_bindings(plan: ConversionPlan, objects: Mapping[str, CheckedObject]) -> None:
    names: set[str] = set()
    for b in plan.bindings:
        _claim_name("binding", "binding name", b.name, names)
        _check_binding(b, objects)
    seen: set[tuple[str, str]] = set()
    for u in plan.uses:
        if u.parameter not in names:
            raise PlanError(f"use of {u.parameter!r} at {u.input!r} names no planned binding")
        if (u.parameter, u.input) in seen:
            raise PlanError(f"use of {u.parameter!r} at {u.input!r} is planned twice")
        seen.add((u.parameter, u.input))
        if u.activation_policy is not None and u.activation_policy not in ACTIVATION_POLICIES:
            raise PlanError(f"use of {u.parameter!r} at {u.input!r}: activation policy "
                            f"{u.activation_policy!r} is not one of {', '.join(sorted(ACTIVATION_POLICIES))}")


def _check_binding(b: BindingPlan, objects: Mapping[str, CheckedObject]) -> None:
    if (b.object is None) == (not b.parts):
        raise PlanError(f"binding {b.name!r} must name either a whole object or parts, exactly one of the two")
    if b.object is not None:
        if b.object not in objects:
            raise PlanError(f"binding {b.name!r} names object {b.object!r}, which is not planned")
        return
    for p in b.parts:
        obj = objects.get(p.object)
        if obj is None:
            raise PlanError(f"binding {b.name!r} has a part of object {p.object!r}, which is not planned")
        if not (type(p.begin) is int and type(p.end) is int and 0 <= p.begin < p.end <= obj.elements):
            raise PlanError(f"binding {b.name!r}: part [{p.begin}, {p.end}) of object {p.object!r} is empty "
                            f"or outside its {obj.elements} elements")
