"""The converter's contract with an architecture plugin: how a source checkpoint maps onto a V3 artifact.

A :class:`SourceMapping` looks at a Hugging Face ``config.json`` and the list of source tensors
(names, shapes, dtypes; no data) and returns a :class:`ConversionPlan`. The converter then streams
tensors into objects exactly as planned. Invariants the converter enforces:

- every source tensor is consumed by exactly one object or listed in ``ignored``; any other tensor
  fails the conversion, naming it;
- an object's ``sources`` are concatenated along dim 0 in order (one source = plain import), with
  identical trailing dims and dtype; a source is a whole tensor (its name) or a :class:`SourceRows`
  range of its dim-0 rows, and the ranges of one tensor must all sit in one object and cover its rows
  exactly once (a layout reorder, e.g. de-interleaving per-head rows, never a duplicate or a drop);
- with ``format=None`` the stored bytes equal the source bytes (value-preserving import);
- every binding references planned objects, and every ``Part`` range lies inside its object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the source checkpoint: ``dtype`` is the safetensors name (``BF16``, ``F32``...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SourceRows:
    """Rows ``[begin, end)`` (dim 0) of source tensor ``name``: lets an object store a tensor's rows in
    another order, or interleave them with other sources (e.g. a fused projection whose per-head query
    and gate rows a checkpoint interleaves). Every row of the tensor is consumed exactly once."""

    name: str
    begin: int
    end: int


def source_name(source: str | SourceRows) -> str:
    """The source tensor an :attr:`ObjectPlan.sources` entry reads."""
    return source.name if isinstance(source, SourceRows) else source


@dataclass(frozen=True)
class ComponentPlan:
    """An artifact component (``text``, ``vision``, ``mtp``...). ``config`` is the compact instance
    config stored in the artifact (must hold ``architectures``); ``target`` names the component a
    vision or speculative component attaches to."""

    id: str
    config: Mapping[str, Any]
    target: str | None = None


@dataclass(frozen=True)
class ObjectPlan:
    """One physical object: its ``sources`` (whole tensors by name, or :class:`SourceRows`) concatenated
    along dim 0. ``format``: None keeps the source dtype; otherwise ``bf16``, ``fp16``, ``fp32`` or
    ``int32`` (a value-changing cast, recorded in provenance)."""

    id: str
    component: str
    sources: tuple[str | SourceRows, ...]
    format: str | None = None


@dataclass(frozen=True)
class Part:
    """Elements ``[begin, end)`` (logical elements, C order) of object ``object``."""

    object: str
    begin: int
    end: int


@dataclass(frozen=True)
class BindingPlan:
    """A logical parameter: either a whole ``object`` or ordered ``parts`` (exactly one of the two)."""

    name: str
    object: str | None = None
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True)
class UsePlan:
    parameter: str
    input: str
    activation_policy: str | None = None  # "A16Only" | "AllowA8" | "AllowA4"


@dataclass(frozen=True)
class ConversionPlan:
    components: tuple[ComponentPlan, ...]
    objects: tuple[ObjectPlan, ...]
    bindings: tuple[BindingPlan, ...]
    uses: tuple[UsePlan, ...] = ()
    ignored: Mapping[str, str] = field(default_factory=dict)  # source name -> why it is dropped


@runtime_checkable
class SourceMapping(Protocol):
    """Registered through the ``ninfer_source_mappings`` hook.

    ``name``: a label for ``ninfer plugins``. ``source_architectures``: the ``architectures[0]``
    values of source ``config.json`` files it converts. ``plan`` must not read tensor data.
    """

    name: str
    source_architectures: tuple[str, ...]

    def plan(self, config: Mapping[str, Any], tensors: Mapping[str, SourceTensor]) -> ConversionPlan: ...
