"""Plan execution: a Hugging Face checkpoint folder -> a V3 ``.ninfer`` artifact.

:func:`convert` reads the source headers, asks the architecture plugin's source mapping for a
:class:`~ninfer.artifact.source_mapping.ConversionPlan`, checks it (:mod:`ninfer.conversion.plan`),
then streams every object into :class:`~ninfer.artifact.writer.ArtifactWriter`. Invariants:

- nothing is published unless every object was written completely: on any failure the writer is
  aborted, and an existing output is refused before any work;
- an object without a cast stores exactly the source bytes (raw copies from the safetensors data
  section, never through torch); a multi-source object is its sources' bytes back to back (a
  :class:`~ninfer.artifact.source_mapping.SourceRows` source: that row range's bytes);
- memory stays bounded by one chunk (at most ``CHUNK_BYTES``, and never more than one tensor) of
  source bytes plus, for a cast, that chunk's cast copy: tensors are streamed, never gathered;
- with a quantization recipe (:mod:`ninfer.conversion.recipe`), the objects it selects are encoded by
  :mod:`ninfer.conversion.quantize` (whole rows at a time, the same bound);
- provenance names the source folder, every source file read with its size, the converter version,
  the source mapping, every cast and every ignored tensor with its reason.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

from tqdm import tqdm

from ninfer.artifact.format import DEFAULT_MAX_FILE_BYTES
from ninfer.artifact.source_mapping import SourceRows, source_name
from ninfer.artifact.writer import ArtifactWriter
from ninfer.conversion.cast import ROUNDING, cast_chunk
from ninfer.conversion.draft import attach_draft
from ninfer.conversion.errors import ConversionError, OutputExistsError, PlanError, SourceError
from ninfer.conversion.plan import CheckedObject, CheckedPlan, check_plan
from ninfer.conversion.quantize import encoder_name, write_quantized
from ninfer.conversion.recipe import Recipe, assign, load_recipe
from ninfer.conversion.resource_checks import check_frontend_loads
from ninfer.conversion.resources import Resource, collect_resources
from ninfer.conversion.source import CONFIG_NAME, SourceCheckpoint, SourceFile, open_checkpoint
from ninfer.errors import NInferError
from ninfer.plugins import PluginRegistry, get_registry
from ninfer.quant.fp8_row import FORMAT as FP8_ROW

# Bytes read per step. Large enough that per-call overhead vanishes, small enough that a 2 GB
# embedding never sits in memory whole. A multiple of every element size (whole elements per cast).
CHUNK_BYTES = 16 * 1024 * 1024
# The distribution the converter ships in, named in provenance.converter.
CONVERTER = "ninfer-core"


def converter_version() -> str:
    """The version of the distribution this converter ships in (recorded in every artifact's provenance)."""
    try:
        return md.version(CONVERTER)
    except md.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`convert` published: ``paths`` (entry file first, then parts) and a summary."""

    paths: tuple[Path, ...]
    architecture: str
    source_mapping: str
    objects: int
    tensor_bytes: int
    resources: tuple[str, ...]
    casts: tuple[str, ...]
    ignored: tuple[str, ...]
    quantized: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def convert(source: str | Path, output: str | Path, *, name: str | None = None,
            max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, registry: PluginRegistry | None = None,
            progress: bool | None = None, quantize: str | Recipe | None = None,
            draft: str | Path | None = None) -> ConversionResult:
    """Convert the checkpoint folder ``source`` into the artifact ``output`` (plus parts if needed).

    ``name`` sets ``metadata.name`` (default: the source folder's name, as a user calls the model; never the
    architecture class). ``registry`` supplies the
    source mappings (default: the process-wide :func:`ninfer.plugins.get_registry`). ``progress``
    shows a byte progress bar on stderr: ``None`` means only when stderr is a terminal. ``quantize`` is a
    recipe (a preset name or a TOML file path, :func:`ninfer.conversion.recipe.load_recipe`) or None.
    ``draft``: a separate draft checkpoint folder the target's mapping adds as a component
    (:mod:`ninfer.conversion.draft`).
    """
    text = os.fspath(output)
    if isinstance(text, str) and text.endswith(("/", os.sep)) or os.path.isdir(output):
        # Path() drops a trailing separator, so 'out/' would otherwise become a file named 'out'.
        raise ConversionError(f"output {text!r} names a folder; give the artifact file to create, e.g. "
                              f"{os.path.join(text, 'model.ninfer')!r}")
    output = Path(output)
    if os.path.lexists(output):
        raise OutputExistsError(f"output {str(output)!r} already exists; the converter never overwrites")
    if not output.parent.is_dir():
        why = "is not a folder" if output.parent.exists() else "does not exist"
        raise ConversionError(f"output folder {str(output.parent)!r} {why}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConversionError(f"the public name (--name) must be a non-empty string, got {name!r}")
    if type(max_file_bytes) is not int or max_file_bytes <= 0:
        raise ConversionError(f"max_file_bytes must be a positive integer, got {max_file_bytes!r}")

    ckpt = open_checkpoint(source)
    registry = registry if registry is not None else get_registry()
    mapping = registry.source_mapping(ckpt.architecture)
    plan = _run_mapping(mapping, ckpt)
    draft_record = None
    if draft is not None:
        plan, ckpt, draft_record = attach_draft(mapping, plan, ckpt, draft)
    checked = check_plan(plan, ckpt.tensors)
    recipe = load_recipe(quantize) if isinstance(quantize, str) else quantize
    formats: dict[str, str] = {}
    if recipe is not None:
        formats = assign(recipe, checked.plan, {o.id: o.shape for o in checked.objects})
        checked = CheckedPlan(checked.plan, tuple(replace(o, format=formats[o.id], cast=True) if o.id in formats
                                                  else o for o in checked.objects))
    resources = collect_resources(ckpt.folder, {c.id for c in checked.plan.components})
    check_frontend_loads(registry, next(c.config for c in checked.plan.components if c.id == "text"), resources)
    clash = {r.object_id for r in resources} & {o.id for o in checked.objects}
    if clash:
        raise PlanError(f"planned object id {sorted(clash)[0]!r} collides with a frontend resource id")

    writer = ArtifactWriter(output, max_file_bytes=max_file_bytes)
    try:
        _declare(writer, checked, resources, ckpt, mapping.name, name or Path(ckpt.folder).resolve().name, recipe,
                 draft_record)
        writer.begin_payload()
        total = sum(_source_span(ckpt, s)[1] for o in checked.objects for s in o.sources)
        show = sys.stderr.isatty() if progress is None else progress
        with tqdm(total=total + sum(r.nbytes for r in resources), unit="B", unit_scale=True,
                  unit_divisor=1024, file=sys.stderr, disable=not show, desc=output.name) as bar:
            _write_objects(writer, checked, ckpt, bar.update, recipe is not None and recipe.method == "search")
            for r in resources:
                writer.write(r.object_id, r.read())
                bar.update(r.nbytes)
        paths = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return ConversionResult(
        paths=tuple(Path(p) for p in paths),
        architecture=ckpt.architecture,
        source_mapping=mapping.name,
        objects=len(checked.objects),
        tensor_bytes=sum(o.nbytes for o in checked.objects),
        resources=tuple(r.object_id for r in resources),
        casts=tuple(o.id for o in checked.casts),
        ignored=tuple(checked.plan.ignored),
        quantized=MappingProxyType(formats),
    )


def _run_mapping(mapping: Any, ckpt: SourceCheckpoint):
    try:
        return mapping.plan(ckpt.config, ckpt.tensors)
    except NInferError:
        raise
    except Exception as exc:  # a plugin bug must still say which mapping and which checkpoint
        raise PlanError(f"source mapping {getattr(mapping, 'name', mapping)!r} failed to plan "
                        f"{str(ckpt.folder)!r}: {type(exc).__name__}: {exc}") from exc


def _declare(writer: ArtifactWriter, checked: CheckedPlan, resources: tuple[Resource, ...],
             ckpt: SourceCheckpoint, mapping_name: str, public_name: str, recipe: Recipe | None,
             draft_record: dict[str, Any] | None = None) -> None:
    """Everything of the directory, in the order the payload will be written."""
    plan = checked.plan
    roles: dict[str, dict[str, str]] = {}
    for r in resources:
        roles.setdefault(r.component, {})[r.role] = r.object_id
    for c in plan.components:
        writer.add_component(c.id, _plain(c.config), target=c.target, resources=roles.get(c.id) or None)
    for o in checked.objects:
        writer.declare_tensor(o.id, o.shape, o.format)
    for r in resources:
        writer.declare_resource(r.object_id, r.nbytes)
    for b in plan.bindings:
        if b.object is not None:
            writer.bind(b.name, b.object)
        else:
            writer.bind_parts(b.name, [(p.object, p.begin, p.end) for p in b.parts])
    a8 = _a8_parameters(checked) if recipe is not None and recipe.activations == "a8" else frozenset()
    for u in plan.uses:
        policy = "AllowA8" if u.parameter in a8 and u.activation_policy == "A16Only" else u.activation_policy
        writer.add_use(u.parameter, u.input, policy)
    writer.set_metadata({"name": public_name})
    prov = _provenance(checked, resources, ckpt, mapping_name, recipe)
    if draft_record is not None:
        prov["draft"] = draft_record
    writer.set_provenance(prov)


def _a8_parameters(checked: CheckedPlan) -> frozenset[str]:
    """Parameters a recipe with ``activations = "a8"`` lets take 8-bit activations: those bound to fp8 row
    objects only (an A8 product exists for that format alone). AllowA8 is a permission: an op without an A8
    product for a weight (the MoE expert banks) runs it with 16-bit activations."""
    fp8 = {o.id for o in checked.objects if o.format == FP8_ROW}
    out = set()
    for b in checked.plan.bindings:
        objs = {b.object} if b.object is not None else {p.object for p in b.parts}
        if objs <= fp8:
            out.add(b.name)
    return frozenset(out)


def _provenance(checked: CheckedPlan, resources: tuple[Resource, ...], ckpt: SourceCheckpoint,
                mapping_name: str, recipe: Recipe | None) -> dict[str, Any]:
    files: list[SourceFile] = [SourceFile(CONFIG_NAME, ckpt.folder / CONFIG_NAME,
                                          (ckpt.folder / CONFIG_NAME).stat().st_size)]
    if ckpt.index is not None:
        files.append(ckpt.index)
    files.extend(ckpt.weight_files)
    seen = {f.name for f in files}
    for r in resources:
        origin = r.path if r.path is not None else ckpt.folder / str(r.derived_from)
        if origin.name not in seen:
            seen.add(origin.name)
            files.append(SourceFile(origin.name, origin, origin.stat().st_size))
    search = recipe is not None and recipe.method == "search"
    prov: dict[str, Any] = {
        "source": {
            "folder": ckpt.folder.resolve().name,
            "architecture": ckpt.architecture,
            "files": [{"name": f.name, "bytes": f.size} for f in files],
        },
        "converter": {"name": CONVERTER, "version": converter_version()},
        "source_mapping": mapping_name,
        "casts": [{"object": o.id, "from": o.dtype, "to": o.format,
                   "rounding": encoder_name(o.format, search) if o.quantized else ROUNDING} for o in checked.casts],
        "ignored": dict(checked.plan.ignored),
    }
    if recipe is not None:
        prov["quantization"] = {"recipe": recipe.name, "rules": [list(r) for r in recipe.rules],
                                "method": recipe.method, "activations": recipe.activations}
    derived = {r.object_id: r.derived_from for r in resources if r.derived_from is not None}
    if derived:
        prov["derived_resources"] = derived
    return prov


def _write_objects(writer: ArtifactWriter, checked: CheckedPlan, ckpt: SourceCheckpoint,
                   advance: Callable[[int], Any], search: bool) -> None:
    with contextlib.ExitStack() as stack:
        handles: dict[str, BinaryIO] = {}

        def spans(o: CheckedObject):
            for src in o.sources:
                loc = ckpt.locations[source_name(src)]
                f = handles.get(loc.file)
                if f is None:
                    f = handles[loc.file] = stack.enter_context(open(ckpt.weight_file(loc.file).path, "rb"))
                yield (source_name(src), f, *_source_span(ckpt, src))

        for o in checked.objects:
            if o.quantized:
                write_quantized(lambda data, oid=o.id: writer.write(oid, data), o.id, o.format, o.dtype,
                                o.shape[-1], spans(o), CHUNK_BYTES, advance, search)
                continue
            for src_name, f, offset, nbytes in spans(o):
                _copy_tensor(writer, o, src_name, f, offset, nbytes, advance)


def _source_span(ckpt: SourceCheckpoint, src: str | SourceRows) -> tuple[int, int]:
    """(file offset, bytes) of a planned source: a whole tensor, or a dim-0 row range of it (rows are C-order
    contiguous, so a range is one byte span)."""
    loc = ckpt.locations[source_name(src)]
    if not isinstance(src, SourceRows):
        return loc.offset, loc.nbytes
    row_bytes = loc.nbytes // ckpt.tensors[src.name].shape[0]
    return loc.offset + src.begin * row_bytes, (src.end - src.begin) * row_bytes


def _copy_tensor(writer: ArtifactWriter, obj: CheckedObject, src: str, f: BinaryIO, offset: int,
                 nbytes: int, advance: Callable[[int], Any]) -> None:
    f.seek(offset)
    remaining = nbytes
    while remaining:
        # A fresh buffer per chunk: the writer may keep a reference until it has consumed it.
        buf = bytearray(min(CHUNK_BYTES, remaining))
        got = f.readinto(buf)
        if got != len(buf):
            raise SourceError(f"source tensor {src!r} ends early in {f.name!r}: the file changed or is "
                              f"truncated")
        writer.write(obj.id, cast_chunk(buf, obj.dtype, obj.format, obj.id) if obj.cast else memoryview(buf))
        remaining -= got
        advance(got)
        del buf


def _plain(value: Any) -> Any:
    """Component configs as plain JSON containers (plugins may hand in read-only mappings)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
