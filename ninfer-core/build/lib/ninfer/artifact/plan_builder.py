"""PlanBuilder: the bookkeeping a SourceMapping does while it plans one conversion (for any architecture).

A mapping walks its checkpoint's tensor names and, for each parameter, plans the stored object(s) it reads
(:meth:`PlanBuilder.obj`) and the binding that names it (:meth:`PlanBuilder.bind`); :meth:`PlanBuilder.finish`
returns the :class:`~ninfer.artifact.source_mapping.ConversionPlan`. The builder checks early what a plan needs
(the converter's :mod:`ninfer.conversion.plan` checks it again, completely, before any byte is written), so a
mapping's error names the tensor at fault:

- every source tensor named exists, with the shape the config implies;
- a tensor is consumed once (whole), or as row ranges (:class:`SourceRows`) whose cover the plan checker verifies;
- when the plan is finished, every source tensor was consumed or ignored with a reason.

Errors are raised as ``error(message)``, the mapping's own config error class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from math import prod

from ninfer.artifact.source_mapping import (
    BindingPlan,
    ComponentPlan,
    ConversionPlan,
    ObjectPlan,
    Part,
    SourceRows,
    SourceTensor,
    UsePlan,
    source_name,
)

A16 = "A16Only"  # the activation policy of a Use whose activations stay 16-bit


class PlanBuilder:
    """Accumulates one plan (module docstring). ``ignored`` maps a source tensor deliberately not converted
    to the reason."""

    def __init__(self, tensors: Mapping[str, SourceTensor], error: Callable[[str], Exception]) -> None:
        self.tensors = tensors
        self.error = error
        self.consumed: set[str] = set()
        self.objects: list[ObjectPlan] = []
        self.object_shapes: dict[str, tuple[int, ...]] = {}
        self.bindings: list[BindingPlan] = []
        self.uses: list[UsePlan] = []
        self.ignored: dict[str, str] = {}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def obj(self, oid: str, component: str, sources: list[tuple[str | SourceRows, tuple[int, ...]]]) -> str:
        """Plan object ``oid`` as the dim-0 concatenation of ``sources`` (a tensor name or a
        :class:`SourceRows` range of one, with the tensor's expected shape); returns ``oid``."""
        rows = 0
        for src, shape in sources:
            name = source_name(src)
            t = self.tensors.get(name)
            if t is None:
                raise self.error(f"source tensor {name!r} is missing (needed for {oid})")
            if tuple(t.shape) != tuple(shape):
                raise self.error(f"source tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                 f"{tuple(shape)}")
            if name in self.consumed and not isinstance(src, SourceRows):
                raise self.error(f"source tensor {name!r} is consumed twice")
            self.consumed.add(name)
            rows += (src.end - src.begin) if isinstance(src, SourceRows) else (shape[0] if shape else 1)
        first = tuple(sources[0][1])
        whole = len(sources) == 1 and not isinstance(sources[0][0], SourceRows)
        self.objects.append(ObjectPlan(id=oid, component=component, sources=tuple(s for s, _ in sources)))
        self.object_shapes[oid] = first if whole else (rows, *first[1:])
        return oid

    def bind(self, name: str, oid: str, shape: tuple[int, ...], begin: int = 0,
             use: str | None = None, policy: str | None = A16) -> None:
        """Bind ``name`` (logical ``shape``) to elements ``[begin, begin + prod(shape))`` of ``oid``: the whole
        object when that is exactly the object with the same shape, else one Part. ``use``: also record the
        Use ``(name, use)`` with activation ``policy``."""
        if begin == 0 and tuple(shape) == self.object_shapes[oid]:
            self.bindings.append(BindingPlan(name=name, object=oid))
        else:
            self.bindings.append(BindingPlan(name=name, parts=(Part(oid, begin, begin + prod(shape)),)))
        if use is not None:
            self.uses.append(UsePlan(parameter=name, input=use, activation_policy=policy))

    def one(self, name: str, component: str, source: str, shape: tuple[int, ...], *,
            stored: tuple[int, ...] | None = None, use: str | None = None) -> None:
        """``name`` bound to its own object, the one tensor ``source`` (of shape ``stored``, default ``shape``)."""
        self.bind(name, self.obj(name, component, [(source, stored or shape)]), shape, use=use)

    def rows(self, name: str, oid: str, offset_rows: int, shape: tuple[int, ...], use: str | None = None) -> int:
        """Bind ``name`` to ``shape[0]`` rows of 2-D object ``oid`` from row ``offset_rows``; returns the next row."""
        self.bind(name, oid, shape, offset_rows * shape[1], use=use)
        return offset_rows + shape[0]

    def finish(self, components: Sequence[ComponentPlan], model: str) -> ConversionPlan:
        """The plan; a source tensor neither consumed nor ignored is an error naming it (``model``: what the
        tensors were expected to be, e.g. "a Qwen3.5 model")."""
        left = sorted(n for n in self.tensors if n not in self.consumed and n not in self.ignored)
        if left:
            shown = ", ".join(left[:8]) + (f" (+{len(left) - 8} more)" if len(left) > 8 else "")
            raise self.error(f"source tensors not part of {model}: {shown}")
        return ConversionPlan(components=tuple(components), objects=tuple(self.objects),
                              bindings=tuple(self.bindings), uses=tuple(self.uses), ignored=dict(self.ignored))
