"""The typed, frozen records of a V3 artifact's root directory (docs/artifact-v3.md), as
:func:`ninfer.artifact.directory.parse_directory` produces them. Each record holds exactly what the
schema allows; the parser has checked every invariant a record's docstring states."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ninfer.artifact.format import element_count


@dataclass(frozen=True)
class FileRecord:
    """One file of the set. ``path`` is None for the entry, a bare file name (relative to the
    entry's folder) for a part. It holds logical payload ``[payload_begin, payload_end)``."""

    index: int
    path: str | None
    payload_bytes: int
    payload_begin: int

    @property
    def payload_end(self) -> int:
        return self.payload_begin + self.payload_bytes


@dataclass(frozen=True)
class ObjectRecord:
    """A physical object: logical payload bytes ``[offset, offset + bytes)``.

    ``kind`` is ``"tensor"`` (``shape``, ``format``, ``layout`` set; ``encoding`` None) or
    ``"resource"`` (``encoding`` set; the others None). ``checksum`` is ``xxh64:<16 hex>`` over
    the object's encoded bytes.
    """

    id: str
    kind: str
    offset: int
    bytes: int
    checksum: str
    shape: tuple[int, ...] | None = None
    format: str | None = None
    layout: str | None = None
    encoding: str | None = None

    @property
    def end(self) -> int:
        return self.offset + self.bytes

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"

    @property
    def elements(self) -> int:
        """Logical elements of a tensor object (1 for a scalar)."""
        if self.shape is None:
            raise TypeError(f"object {self.id!r} is a resource and has no elements")
        return element_count(self.shape)


@dataclass(frozen=True)
class PartRecord:
    """Logical elements ``[begin, end)`` (C order) of tensor object ``object``; ``begin < end``."""

    object: str
    begin: int
    end: int

    @property
    def elements(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class BindingRecord:
    """A logical parameter's storage: a whole ``object`` xor ordered ``parts`` (non-empty)."""

    object: str | None = None
    parts: tuple[PartRecord, ...] = ()

    def pieces(self, objects: Mapping[str, ObjectRecord]) -> tuple[PartRecord, ...]:
        """The binding as ordered parts; a whole-object binding is one part over all elements."""
        if self.object is not None:
            return (PartRecord(self.object, 0, objects[self.object].elements),)
        return self.parts

    def object_ids(self) -> tuple[str, ...]:
        return (self.object,) if self.object is not None else tuple(p.object for p in self.parts)


@dataclass(frozen=True)
class UseRecord:
    """Where a binding is consumed: ``(parameter, input)`` is unique across the artifact."""

    parameter: str
    input: str
    activation_policy: str | None = None
    auxiliaries: Mapping[str, BindingRecord] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class ComponentRecord:
    """A provided component. ``config`` is the compact instance config (holds ``architectures``);
    ``target`` names the component it attaches to; ``resources`` maps a frontend role to a
    resource object id; ``proposal`` (text only) is ``{"domain": "full"|"indexed", "rows"?: n}``."""

    id: str
    config: dict[str, Any]
    target: str | None = None
    resources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    proposal: dict[str, Any] | None = None

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]


@dataclass(frozen=True)
class Directory:
    """The parsed root. ``objects`` keeps file order (ascending offset); ``object_index`` maps ids."""

    components: Mapping[str, ComponentRecord]
    objects: tuple[ObjectRecord, ...]
    bindings: Mapping[str, BindingRecord]
    uses: tuple[UseRecord, ...]
    files: tuple[FileRecord, ...]
    metadata: dict[str, Any] | None
    provenance: dict[str, Any] | None
    object_index: Mapping[str, ObjectRecord]

    @property
    def payload_bytes(self) -> int:
        """Bytes of the logical payload (all files together)."""
        return self.files[-1].payload_end
