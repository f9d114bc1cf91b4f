"""The binder: logical parameters a selected feature needs -> element ranges of physical parents.

:func:`bind` checks, for every :class:`~ninfer.contracts.architecture.ParameterSpec`:

- its component is declared in the artifact (:class:`MissingComponentError` naming it);
- it has a binding (:class:`MissingBindingError`);
- every object the binding references is interpretable (:class:`UnknownFormatError`,
  :class:`UnknownLayoutError`, :class:`UnsupportedFormatError`) and all share one format;
- the binding covers exactly ``prod(spec.shape)`` elements (:class:`CoverageError`), and a
  whole-object binding's object has exactly ``spec.shape`` (:class:`BindingShapeError`);
- a quantized parameter is one block of whole rows of one parent with the parent's K (a row block or an
  expert slice of a bank), so the loader can hand it over as plane views (:class:`BindingError` otherwise:
  re-ordering quantized rows is the converter's work).

Only the directory is consulted: binding reads no payload, so objects that no selected spec
references are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ninfer.artifact.directory import ObjectRecord
from ninfer.artifact.errors import (
    BindingError,
    BindingShapeError,
    CoverageError,
    MissingBindingError,
    MissingComponentError,
)
from ninfer.artifact.format import element_count, interpret
from ninfer.contracts.architecture import ParameterSpec
from ninfer.quant import row_tile


@dataclass(frozen=True)
class BoundPiece:
    """Logical elements ``[begin, end)`` of tensor parent ``object``."""

    object: ObjectRecord
    begin: int
    end: int

    @property
    def elements(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class BoundParameter:
    """A parameter resolved to ordered pieces whose elements, concatenated, are its C-order values.

    Invariants: ``sum(piece.elements) == prod(shape)``; every piece's parent has format ``format``
    (torch ``dtype``; uint8 for a ``quantized`` format, whose parameter is always one view); adjacent pieces of one parent that touch are merged, so ``is_view`` holds
    exactly when the parameter is one contiguous range of one parent.
    """

    name: str
    shape: tuple[int, ...]
    component: str
    format: str
    dtype: torch.dtype
    pieces: tuple[BoundPiece, ...]
    quantized: bool = False

    @property
    def is_view(self) -> bool:
        return len(self.pieces) == 1

    @property
    def parent_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.object.id for p in self.pieces))

    @property
    def nbytes(self) -> int:
        return element_count(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BoundWeights:
    """Everything the selected specs bind, placement-free. ``parents`` is deduplicated, by offset."""

    path: Path
    artifact_id: str
    components: tuple[str, ...]
    parameters: tuple[BoundParameter, ...]

    @property
    def parents(self) -> tuple[ObjectRecord, ...]:
        seen = {p.object.id: p.object for bp in self.parameters for p in bp.pieces}
        return tuple(sorted(seen.values(), key=lambda o: o.offset))


def bind(reader, specs: Sequence[ParameterSpec]) -> BoundWeights:
    """Resolve ``specs`` against ``reader``'s directory (see the module docstring for the checks)."""
    directory = reader.directory
    where = str(reader.path)
    seen: set[str] = set()
    components: list[str] = []
    out: list[BoundParameter] = []
    for spec in specs:
        if spec.name in seen:
            raise BindingError(f"{where}: parameter {spec.name!r} is requested twice")
        seen.add(spec.name)
        if spec.component not in directory.components:
            have = ", ".join(directory.components)
            raise MissingComponentError(
                f"{where}: component {spec.component!r} (needed by parameter {spec.name!r}) is not in "
                f"this artifact (it provides: {have})")
        if spec.component not in components:
            components.append(spec.component)
        binding = directory.bindings.get(spec.name)
        if binding is None:
            raise MissingBindingError(f"{where}: parameter {spec.name!r} (component {spec.component!r}) "
                                      f"has no binding")
        want = element_count(spec.shape)
        if binding.object is not None:
            obj = directory.object_index[binding.object]
            if obj.elements != want:
                raise CoverageError(f"{where}: binding {spec.name!r} is object {obj.id!r} with {obj.elements} "
                                    f"elements {list(obj.shape)}, the parameter has {want} {list(spec.shape)}")
            if obj.shape != tuple(spec.shape):
                raise BindingShapeError(f"{where}: binding {spec.name!r} is object {obj.id!r} of shape "
                                        f"{list(obj.shape)}, the parameter's shape is {list(spec.shape)}")
        pieces = [BoundPiece(directory.object_index[p.object], p.begin, p.end)
                  for p in binding.pieces(directory.object_index)]
        covered = sum(p.elements for p in pieces)
        if covered != want:
            raise CoverageError(f"{where}: binding {spec.name!r} parts cover {covered} elements, the parameter "
                                f"{list(spec.shape)} has {want}")
        fmt = None
        for piece in pieces:
            info = interpret(piece.object.format, piece.object.layout, object_id=piece.object.id, path=where)
            if fmt is None:
                fmt = info
            elif info.name != fmt.name:
                raise BindingError(f"{where}: binding {spec.name!r} mixes formats {fmt.name!r} and "
                                   f"{info.name!r} (object {piece.object.id!r})")
        merged = _merge(pieces)
        if fmt.quantized:
            _check_rows(where, spec, merged)
        out.append(BoundParameter(spec.name, tuple(spec.shape), spec.component, fmt.name, fmt.dtype,
                                  merged, fmt.quantized))
    return BoundWeights(reader.path, reader.artifact_id, tuple(components), tuple(out))


def _check_rows(where: str, spec: ParameterSpec, pieces: tuple[BoundPiece, ...]) -> None:
    parent = pieces[0].object
    k = parent.shape[-1]
    p = pieces[0]
    if (len(pieces) != 1 or len(spec.shape) < 2 or spec.shape[-1] != k or p.begin % k or p.end % k):
        raise BindingError(
            f"{where}: binding {spec.name!r} {list(spec.shape)} of {parent.format} parent {parent.id!r} "
            f"{list(parent.shape)} is not one block of whole rows with the parent's K = {k}; a quantized "
            f"parameter must be a row block or an expert slice (re-order rows at conversion)")
    tile = row_tile(parent.format)
    if (p.begin // k) % tile or (p.end // k) % tile:
        raise BindingError(
            f"{where}: binding {spec.name!r} takes rows [{p.begin // k}, {p.end // k}) of {parent.format} parent "
            f"{parent.id!r} {list(parent.shape)}; that format's scales come in tiles of {tile} rows, so a "
            f"parameter must start and end on a tile (re-order rows at conversion)")


def _merge(pieces: list[BoundPiece]) -> tuple[BoundPiece, ...]:
    """Join touching ranges of one parent, so a reshape-only binding stays a zero-copy view."""
    merged: list[BoundPiece] = []
    for p in pieces:
        last = merged[-1] if merged else None
        if last is not None and last.object.id == p.object.id and last.end == p.begin:
            merged[-1] = BoundPiece(p.object, last.begin, p.end)
        else:
            merged.append(p)
    return tuple(merged)
