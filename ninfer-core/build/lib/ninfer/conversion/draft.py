"""Converting a target with a separate draft checkpoint (``ninfer-convert TARGET OUT --draft DRAFT_DIR``).

A speculative drafter published as its own Hugging Face folder (e.g. a DFlash block-diffusion drafter) becomes
one more component of the target's artifact. The target's source mapping decides whether and how: it must
implement :class:`DraftSourceMapping` (``plan_draft``); any other mapping refuses a draft by name.

:func:`attach_draft` merges the two folders into one :class:`~ninfer.conversion.source.SourceCheckpoint` and one
:class:`~ninfer.artifact.source_mapping.ConversionPlan`, so the pipeline streams both with its usual guarantees.
Invariants:

- the draft's tensors are renamed ``draft:<name>`` (its weight files ``draft/<file>``), so they can never collide
  with the target's; the draft mapping plans with the draft's own names and this module renames its sources
  and ignored entries;
- the draft plan adds components of its own only (a component id the target plan has is an error), may replace
  the config of target components (``DraftPlan.target_configs``, e.g. the text config naming its drafter) and
  must consume or ignore every draft tensor (the plan checker enforces it, as for the target);
- provenance gains a ``draft`` record: the draft folder's name, its architecture and every file read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ninfer.artifact.source_mapping import ConversionPlan, ObjectPlan, SourceRows, SourceTensor
from ninfer.conversion.errors import PlanError
from ninfer.conversion.source import (
    CONFIG_NAME,
    SourceCheckpoint,
    SourceFile,
    TensorLocation,
    open_checkpoint,
)

#: Prefix of a draft tensor's name (and ``DRAFT_DIR + "/"`` of its weight files) in the merged checkpoint.
DRAFT_PREFIX = "draft:"
_FILE_PREFIX = "draft/"


@dataclass(frozen=True)
class DraftPlan:
    """What a draft adds: ``plan`` (its own components, objects sourced by the draft's tensor names, bindings,
    uses, ignored tensors) and ``target_configs`` (component id -> a replacement config of a target component)."""

    plan: ConversionPlan
    target_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@runtime_checkable
class DraftSourceMapping(Protocol):
    """A source mapping that accepts a draft checkpoint beside its target's. ``plan_draft`` must not read tensor
    data; it checks that the draft fits the target (``target``: the target's plan) and raises an error naming
    what does not."""

    def plan_draft(self, config: Mapping[str, Any], tensors: Mapping[str, SourceTensor],
                   target: ConversionPlan) -> DraftPlan: ...


def attach_draft(mapping: Any, plan: ConversionPlan, ckpt: SourceCheckpoint, draft_folder: str | Path
                 ) -> tuple[ConversionPlan, SourceCheckpoint, dict[str, Any]]:
    """``(merged plan, merged checkpoint, provenance record)`` of the target ``plan`` / ``ckpt`` (planned by
    ``mapping``) with the draft checkpoint folder ``draft_folder`` (module docstring)."""
    if not isinstance(mapping, DraftSourceMapping):
        raise PlanError(f"source mapping {getattr(mapping, 'name', mapping)!r} of architecture {ckpt.architecture!r} "
                        f"takes no draft checkpoint (--draft)")
    draft = open_checkpoint(draft_folder)
    added = mapping.plan_draft(draft.config, draft.tensors, plan)
    if not isinstance(added, DraftPlan):
        raise PlanError(f"source mapping {getattr(mapping, 'name', mapping)!r} returned {type(added).__name__} from "
                        f"plan_draft, not a DraftPlan")
    have = {c.id for c in plan.components}
    clash = sorted(c.id for c in added.plan.components if c.id in have)
    if clash:
        raise PlanError(f"the draft plan adds component(s) {clash} the target already has")
    unknown = sorted(set(added.target_configs) - have)
    if unknown:
        raise PlanError(f"the draft plan replaces the config of component(s) {unknown}, which the target lacks")
    components = tuple(replace(c, config=added.target_configs[c.id]) if c.id in added.target_configs else c
                       for c in plan.components) + tuple(added.plan.components)
    objects = tuple(ObjectPlan(o.id, o.component, tuple(_rename(s) for s in o.sources), o.format)
                    for o in added.plan.objects)
    merged = ConversionPlan(
        components=components, objects=plan.objects + objects, bindings=plan.bindings + added.plan.bindings,
        uses=plan.uses + added.plan.uses,
        ignored={**plan.ignored, **{DRAFT_PREFIX + k: v for k, v in added.plan.ignored.items()}})
    return merged, _merge(ckpt, draft), _provenance(draft)


def _rename(src: str | SourceRows) -> str | SourceRows:
    if isinstance(src, SourceRows):
        return SourceRows(DRAFT_PREFIX + src.name, src.begin, src.end)
    return DRAFT_PREFIX + src


def _merge(target: SourceCheckpoint, draft: SourceCheckpoint) -> SourceCheckpoint:
    tensors: dict[str, SourceTensor] = dict(target.tensors)
    locations: dict[str, TensorLocation] = dict(target.locations)
    for name, t in draft.tensors.items():
        tensors[DRAFT_PREFIX + name] = SourceTensor(DRAFT_PREFIX + name, t.shape, t.dtype)
        loc = draft.locations[name]
        locations[DRAFT_PREFIX + name] = TensorLocation(_FILE_PREFIX + loc.file, loc.offset, loc.nbytes)
    files = target.weight_files + tuple(SourceFile(_FILE_PREFIX + f.name, f.path, f.size) for f in draft.weight_files)
    return replace(target, weight_files=files, tensors=tensors, locations=locations)


def _provenance(draft: SourceCheckpoint) -> dict[str, Any]:
    files = [SourceFile(CONFIG_NAME, draft.folder / CONFIG_NAME, (draft.folder / CONFIG_NAME).stat().st_size)]
    if draft.index is not None:
        files.append(draft.index)
    files.extend(draft.weight_files)
    return {"folder": draft.folder.resolve().name, "architecture": draft.architecture,
            "files": [{"name": f.name, "bytes": f.size} for f in files]}

