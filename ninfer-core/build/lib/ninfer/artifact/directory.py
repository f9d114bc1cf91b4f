"""The root JSON directory of a V3 artifact: strict parsing into typed, frozen records.

:func:`parse_directory` accepts exactly the schema of docs/artifact-v3.md and nothing else:

- member names are unique in every JSON object; NaN/Infinity are rejected;
- closed records (root, component, object, binding, part, use, file, proposal) reject unknown
  fields; ``config``, ``metadata`` and ``provenance`` are open objects;
- integers are exact JSON integers (never booleans or floats) within unsigned 64 bits;
- ``components`` holds ``text``; ``files[0]`` is the entry (``path`` null), later paths are bare
  file names; objects are sorted by offset, unique, non-overlapping, inside the logical payload,
  tensors 256-aligned and, where the format is loadable, exactly their encoded size;
- every reference (component target, resource role, binding object, use parameter) resolves, and
  every Part range is a non-empty element range inside its object.

Unknown formats and layouts are *not* directory errors: they fail when the object is interpreted
(:func:`ninfer.artifact.format.interpret`), so a file with a format this engine cannot load still
opens and its other components still load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ninfer.artifact.errors import (
    DuplicateIdError,
    DuplicateMemberError,
    MalformedJSONError,
    MisalignedObjectError,
    ObjectRangeError,
    ObjectSizeError,
    OverlappingObjectsError,
    PartRangeError,
    SchemaError,
    UnknownFieldError,
    UnknownReferenceError,
)
from ninfer.artifact.format import (
    MAX_RANK,
    TENSOR_ALIGN,
    encoded_size,
    is_interpretable,
)
from ninfer.artifact.records import (
    BindingRecord,
    ComponentRecord,
    Directory,
    FileRecord,
    ObjectRecord,
    PartRecord,
    UseRecord,
)

U64_MAX = 2**64 - 1
ACTIVATION_POLICIES: tuple[str, ...] = ("A16Only", "AllowA8", "AllowA4")
PROPOSAL_DOMAINS: tuple[str, ...] = ("full", "indexed")
_CHECKSUM_RE = re.compile(r"xxh64:[0-9a-f]{16}")


# -- parsing -------------------------------------------------------------------------------------
class _Parser:
    def __init__(self, path) -> None:
        self.where = str(path)

    def err(self, cls, msg: str):
        return cls(f"{self.where}: {msg}")

    # primitive checks ---------------------------------------------------------------------------
    def record(self, value: Any, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(value, dict):
            raise self.err(SchemaError, f"{what} must be a JSON object, got {_jtype(value)}")
        unknown = [k for k in value if k not in required and k not in optional]
        if unknown:
            raise self.err(UnknownFieldError, f"{what} has unknown field(s) {', '.join(map(repr, unknown))}")
        missing = [k for k in required if k not in value]
        if missing:
            raise self.err(SchemaError, f"{what} lacks required field(s) {', '.join(map(repr, missing))}")
        return value

    def u64(self, value: Any, what: str, *, positive: bool = False) -> int:
        # bool is an int subclass in Python; JSON true/false are never integers here.
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.err(SchemaError, f"{what} must be an integer, got {_jtype(value)}")
        low = 1 if positive else 0
        if not low <= value <= U64_MAX:
            kind = "a positive" if positive else "an unsigned"
            raise self.err(SchemaError, f"{what} must be {kind} 64-bit integer, got {value}")
        return value

    def ident(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or not value or "\x00" in value:
            raise self.err(SchemaError, f"{what} must be a non-empty string without NUL, got {value!r}")
        return value

    def string(self, value: Any, what: str) -> str:
        if not isinstance(value, str):
            raise self.err(SchemaError, f"{what} must be a string, got {_jtype(value)}")
        return value

    def obj(self, value: Any, what: str) -> dict:
        if not isinstance(value, dict):
            raise self.err(SchemaError, f"{what} must be a JSON object, got {_jtype(value)}")
        return value

    def array(self, value: Any, what: str, *, non_empty: bool = False) -> list:
        if not isinstance(value, list):
            raise self.err(SchemaError, f"{what} must be a JSON array, got {_jtype(value)}")
        if non_empty and not value:
            raise self.err(SchemaError, f"{what} must not be empty")
        return value

    def shape(self, value: Any, what: str) -> tuple[int, ...]:
        dims = self.array(value, what)
        if len(dims) > MAX_RANK:
            raise self.err(SchemaError, f"{what} has rank {len(dims)} > {MAX_RANK}")
        return tuple(self.u64(d, f"{what}[{i}]", positive=True) for i, d in enumerate(dims))

    # sections ------------------------------------------------------------------------------------
    def files(self, value: Any) -> tuple[FileRecord, ...]:
        out: list[FileRecord] = []
        begin = 0
        seen: set[str] = set()
        for i, raw in enumerate(self.array(value, "files", non_empty=True)):
            what = f"files[{i}]"
            rec = self.record(raw, what, ("path", "payload_bytes"))
            path = rec["path"]
            if i == 0:
                if path is not None:
                    raise self.err(SchemaError, f"{what}.path must be null (the entry file), got {path!r}")
            else:
                path = self.ident(path, f"{what}.path")
                # Parts live beside the entry: a bare name, never a path that could escape the folder.
                if "/" in path or "\\" in path or path in (".", ".."):
                    raise self.err(SchemaError, f"{what}.path must be a bare file name, got {path!r}")
                if path in seen:
                    raise self.err(SchemaError, f"{what}.path {path!r} repeats an earlier part")
                seen.add(path)
            size = self.u64(rec["payload_bytes"], f"{what}.payload_bytes", positive=True)
            out.append(FileRecord(i, path, size, begin))
            begin += size
        return tuple(out)

    def objects(self, value: Any, payload_bytes: int) -> tuple[ObjectRecord, ...]:
        out: list[ObjectRecord] = []
        seen: set[str] = set()
        prev: ObjectRecord | None = None
        for i, raw in enumerate(self.array(value, "objects", non_empty=True)):
            what = f"objects[{i}]"
            if isinstance(raw, dict) and isinstance(raw.get("id"), str):
                what = f"object {raw['id']!r}"
            kind = raw.get("kind") if isinstance(raw, dict) else None
            if kind == "tensor":
                rec = self.record(raw, what, ("id", "kind", "shape", "format", "layout", "offset", "bytes",
                                              "checksum"))
            elif kind == "resource":
                rec = self.record(raw, what, ("id", "kind", "encoding", "offset", "bytes", "checksum"))
            else:
                self.record(raw, what, ("id", "kind"), ("shape", "format", "layout", "encoding", "offset",
                                                         "bytes", "checksum"))
                raise self.err(SchemaError, f"{what}.kind must be 'tensor' or 'resource', got {kind!r}")
            oid = self.ident(rec["id"], f"{what}.id")
            if oid in seen:
                raise self.err(DuplicateIdError, f"object id {oid!r} appears twice in the object table")
            seen.add(oid)
            offset = self.u64(rec["offset"], f"{what}.offset")
            size = self.u64(rec["bytes"], f"{what}.bytes", positive=True)
            checksum = self.string(rec["checksum"], f"{what}.checksum")
            if not _CHECKSUM_RE.fullmatch(checksum):
                raise self.err(SchemaError, f"{what}.checksum must be 'xxh64:' + 16 lowercase hex digits, "
                                            f"got {checksum!r}")
            if kind == "tensor":
                shape = self.shape(rec["shape"], f"{what}.shape")
                fmt = self.ident(rec["format"], f"{what}.format")
                layout = self.ident(rec["layout"], f"{what}.layout")
                obj = ObjectRecord(oid, kind, offset, size, checksum, shape=shape, format=fmt, layout=layout)
                if offset % TENSOR_ALIGN:
                    raise self.err(MisalignedObjectError, f"tensor object {oid!r} offset {offset} is not a "
                                                          f"multiple of {TENSOR_ALIGN}")
                if is_interpretable(fmt, layout):
                    want = encoded_size(fmt, layout, shape, object_id=oid)
                    if want != size:
                        raise self.err(ObjectSizeError, f"object {oid!r} declares {size} bytes but {fmt} "
                                                        f"{list(shape)} encodes to {want}")
            else:
                enc = self.ident(rec["encoding"], f"{what}.encoding")
                obj = ObjectRecord(oid, kind, offset, size, checksum, encoding=enc)
            if prev is not None:
                if offset < prev.offset:
                    raise self.err(ObjectRangeError, f"object {oid!r} (offset {offset}) comes after object "
                                                     f"{prev.id!r} (offset {prev.offset}): objects must be "
                                                     f"sorted by offset")
                if offset < prev.end:
                    raise self.err(OverlappingObjectsError,
                                   f"object {oid!r} [{offset}, {obj.end}) overlaps object {prev.id!r} "
                                   f"[{prev.offset}, {prev.end})")
            if obj.end > payload_bytes:
                raise self.err(ObjectRangeError, f"object {oid!r} [{offset}, {obj.end}) reaches past the "
                                                 f"logical payload ({payload_bytes} bytes in the file table)")
            out.append(obj)
            prev = obj
        return tuple(out)

    def binding(self, value: Any, what: str, objects: Mapping[str, ObjectRecord]) -> BindingRecord:
        if isinstance(value, dict) and "object" in value and "parts" in value:
            raise self.err(SchemaError, f"{what} has both 'object' and 'parts'; a binding has exactly one")
        if isinstance(value, dict) and "object" in value:
            rec = self.record(value, what, ("object",))
            oid = self.ident(rec["object"], f"{what}.object")
            self.tensor_ref(oid, what, objects)
            return BindingRecord(object=oid)
        rec = self.record(value, what, ("parts",))
        parts: list[PartRecord] = []
        for j, raw in enumerate(self.array(rec["parts"], f"{what}.parts", non_empty=True)):
            pw = f"{what}.parts[{j}]"
            prec = self.record(raw, pw, ("object", "range"))
            oid = self.ident(prec["object"], f"{pw}.object")
            obj = self.tensor_ref(oid, pw, objects)
            rng = self.array(prec["range"], f"{pw}.range")
            if len(rng) != 2:
                raise self.err(SchemaError, f"{pw}.range must be [begin, end], got {rng!r}")
            b = self.u64(rng[0], f"{pw}.range[0]")
            e = self.u64(rng[1], f"{pw}.range[1]")
            if not b < e:
                raise self.err(PartRangeError, f"{pw} range [{b}, {e}) of object {oid!r} is empty or reversed")
            if e > obj.elements:
                raise self.err(PartRangeError, f"{pw} range [{b}, {e}) reaches past object {oid!r}, which has "
                                               f"{obj.elements} elements")
            parts.append(PartRecord(oid, b, e))
        return BindingRecord(parts=tuple(parts))

    def tensor_ref(self, oid: str, what: str, objects: Mapping[str, ObjectRecord]) -> ObjectRecord:
        obj = objects.get(oid)
        if obj is None:
            raise self.err(UnknownReferenceError, f"{what} references unknown object {oid!r}")
        if not obj.is_tensor:
            raise self.err(SchemaError, f"{what} references resource object {oid!r}; bindings need tensors")
        return obj

    def components(self, value: Any, objects: Mapping[str, ObjectRecord]) -> dict[str, ComponentRecord]:
        raw = self.obj(value, "components")
        if "text" not in raw:
            raise self.err(SchemaError, "components lacks 'text' (every artifact provides the text component)")
        out: dict[str, ComponentRecord] = {}
        for cid, body in raw.items():
            self.ident(cid, "component id")
            what = f"component {cid!r}"
            rec = self.record(body, what, ("config",), ("target", "resources", "proposal"))
            config = self.obj(rec["config"], f"{what}.config")
            archs = config.get("architectures")
            if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
                raise self.err(SchemaError, f"{what}.config.architectures must be a non-empty list of names")
            target = None
            if "target" in rec:
                target = self.ident(rec["target"], f"{what}.target")
                if target not in raw:
                    raise self.err(UnknownReferenceError, f"{what} targets undeclared component {target!r}")
                if target == cid:
                    raise self.err(SchemaError, f"{what} targets itself")
            resources: dict[str, str] = {}
            for role, oid in self.obj(rec.get("resources", {}), f"{what}.resources").items():
                self.ident(role, f"{what} resource role")
                oid = self.ident(oid, f"{what}.resources[{role!r}]")
                obj = objects.get(oid)
                if obj is None:
                    raise self.err(UnknownReferenceError,
                                   f"{what} resource {role!r} references unknown object {oid!r}")
                if obj.is_tensor:
                    raise self.err(SchemaError, f"{what} resource {role!r} references tensor object {oid!r}")
                resources[role] = oid
            proposal = None
            if "proposal" in rec:
                if cid != "text":
                    raise self.err(SchemaError, f"{what} has a proposal; only the text component may")
                proposal = self.proposal(rec["proposal"], f"{what}.proposal")
            out[cid] = ComponentRecord(cid, config, target, MappingProxyType(resources), proposal)
        return out

    def proposal(self, value: Any, what: str) -> dict[str, Any]:
        rec = self.record(value, what, ("domain",), ("rows",))
        domain = rec["domain"]
        if domain not in PROPOSAL_DOMAINS:
            raise self.err(SchemaError, f"{what}.domain must be one of {PROPOSAL_DOMAINS}, got {domain!r}")
        if domain == "indexed":
            if "rows" not in rec:
                raise self.err(SchemaError, f"{what}: an indexed proposal needs 'rows'")
            self.u64(rec["rows"], f"{what}.rows", positive=True)
        elif "rows" in rec:
            raise self.err(SchemaError, f"{what}: 'rows' is only defined for domain 'indexed'")
        return dict(rec)

    def uses(self, value: Any, bindings: Mapping[str, BindingRecord],
             objects: Mapping[str, ObjectRecord]) -> tuple[UseRecord, ...]:
        out: list[UseRecord] = []
        seen: set[tuple[str, str]] = set()
        for i, raw in enumerate(self.array(value, "uses")):
            what = f"uses[{i}]"
            rec = self.record(raw, what, ("parameter", "input"), ("activation_policy", "auxiliaries"))
            param = self.ident(rec["parameter"], f"{what}.parameter")
            inp = self.ident(rec["input"], f"{what}.input")
            if param not in bindings:
                raise self.err(UnknownReferenceError, f"{what} uses parameter {param!r}, which has no binding")
            if (param, inp) in seen:
                raise self.err(SchemaError, f"{what}: use ({param!r}, {inp!r}) appears twice")
            seen.add((param, inp))
            policy = rec.get("activation_policy")
            if "activation_policy" in rec and policy not in ACTIVATION_POLICIES:
                raise self.err(SchemaError, f"{what}.activation_policy must be one of {ACTIVATION_POLICIES}, "
                                            f"got {policy!r}")
            aux = {}
            for role, b in self.obj(rec.get("auxiliaries", {}), f"{what}.auxiliaries").items():
                self.ident(role, f"{what} auxiliary role")
                aux[role] = self.binding(b, f"{what}.auxiliaries[{role!r}]", objects)
            out.append(UseRecord(param, inp, policy, MappingProxyType(aux)))
        return tuple(out)


def _jtype(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def load_json(raw: bytes, path) -> Any:
    """Decode UTF-8 JSON, rejecting duplicate member names and NaN/Infinity."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, val in items:
            if key in out:
                raise DuplicateMemberError(f"{path}: JSON member {key!r} appears twice in one object")
            out[key] = val
        return out

    def constant(name: str):
        raise MalformedJSONError(f"{path}: JSON constant {name} is not allowed")

    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except UnicodeDecodeError as exc:
        raise MalformedJSONError(f"{path}: directory is not valid UTF-8 ({exc})") from None
    except json.JSONDecodeError as exc:
        raise MalformedJSONError(f"{path}: malformed JSON directory: {exc}") from None
    except RecursionError:
        raise MalformedJSONError(f"{path}: JSON directory nests too deeply") from None


def parse_directory(raw: bytes, *, path) -> Directory:
    """Parse and validate the directory bytes of the artifact at ``path`` (used in messages)."""
    root = load_json(raw, path)
    p = _Parser(path)
    rec = p.record(root, "root directory", ("components", "objects", "bindings", "uses", "files"),
                   ("metadata", "provenance"))
    files = p.files(rec["files"])
    objects = p.objects(rec["objects"], files[-1].payload_end)
    index = MappingProxyType({o.id: o for o in objects})
    components = p.components(rec["components"], index)
    bindings: dict[str, BindingRecord] = {}
    for name, body in p.obj(rec["bindings"], "bindings").items():
        p.ident(name, "binding name")
        bindings[name] = p.binding(body, f"binding {name!r}", index)
    uses = p.uses(rec["uses"], bindings, index)
    metadata = rec.get("metadata")
    if "metadata" in rec:
        p.obj(metadata, "metadata")
        if "name" in metadata:
            p.ident(metadata["name"], "metadata.name")
    provenance = rec.get("provenance")
    if "provenance" in rec:
        p.obj(provenance, "provenance")
    return Directory(
        components=MappingProxyType(components), objects=objects, bindings=MappingProxyType(bindings),
        uses=uses, files=files, metadata=metadata, provenance=provenance, object_index=index)


__all__ = [
    "ACTIVATION_POLICIES", "BindingRecord", "ComponentRecord", "Directory", "FileRecord", "ObjectRecord",
    "PartRecord", "UseRecord", "load_json", "parse_directory",
]
