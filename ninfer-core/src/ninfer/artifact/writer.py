"""ArtifactWriter: streams a V3 ``.ninfer`` file set to disk (docs/artifact-v3.md, "Writing").

Two phases:

1. *Declare* components, tensors, resources, bindings, uses, metadata and provenance, in any
   order. Objects are laid out in declaration order (tensors 256-aligned, resources packed).
2. ``begin_payload()`` freezes the directory: it computes every offset and the file split (the
   per-file cap counts header, JSON and padding), renders the JSON with fixed-width placeholder
   checksums, validates it with the reader's own :func:`~ninfer.artifact.directory.parse_directory`,
   and creates the temp files beside the target. ``write()`` then streams each object's bytes, in
   declaration order, straight to the right offsets (objects may straddle files) while hashing
   them; ``finish()`` rewrites the JSON in place with the real checksums (same length), fsyncs,
   and publishes parts first and the entry last, never replacing an existing file.

Invariants: a failure at any point leaves no temp file and no entry file behind; a published
entry always has all its parts; the writer never overwrites an existing target.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from ninfer.artifact.directory import parse_directory
from ninfer.artifact.errors import SchemaError, TargetExistsError, WriterError
from ninfer.artifact.format import (
    ARTIFACT_ID_BYTES,
    CHECKSUM_PLACEHOLDER,
    DEFAULT_MAX_FILE_BYTES,
    FORMATS,
    HEADER_BYTES,
    LAYOUT_CONTIGUOUS,
    MAX_RANK,
    PART_PAYLOAD_START,
    PAYLOAD_ALIGN,
    RESOURCE_ALIGN,
    RESOURCE_ENCODING,
    TENSOR_ALIGN,
    EntryHeader,
    PartHeader,
    align_up,
    checksum_string,
    encoded_size,
    part_file_name,
)


@dataclass
class _Object:
    id: str
    kind: str
    nbytes: int
    shape: tuple[int, ...] | None = None
    format: str | None = None
    layout: str = LAYOUT_CONTIGUOUS
    offset: int = -1
    written: int = 0
    hasher: Any = field(default_factory=xxhash.xxh64)

    def record(self, checksum: str) -> dict[str, Any]:
        if self.kind == "tensor":
            return {"id": self.id, "kind": "tensor", "shape": list(self.shape), "format": self.format,
                    "layout": self.layout, "offset": self.offset, "bytes": self.nbytes,
                    "checksum": checksum}
        return {"id": self.id, "kind": "resource", "encoding": RESOURCE_ENCODING, "offset": self.offset,
                "bytes": self.nbytes, "checksum": checksum}


@dataclass
class _File:
    target: Path
    payload_start: int      # file offset of its first payload byte
    payload_begin: int      # logical payload offset it starts at
    payload_bytes: int
    temp: Path | None = None
    fd: int | None = None

    @property
    def length(self) -> int:
        return self.payload_start + self.payload_bytes


def _publish_file(temp: Path, target: Path) -> None:
    """Move ``temp`` to ``target`` without ever replacing an existing ``target``."""
    try:
        os.link(temp, target)  # atomic and fails if target exists
    except FileExistsError:
        raise TargetExistsError(f"{target}: already exists; the writer never overwrites") from None
    except OSError:
        # Filesystems without hard links: check, then rename (the check-to-rename window is tiny).
        if os.path.lexists(target):
            raise TargetExistsError(f"{target}: already exists; the writer never overwrites") from None
        os.rename(temp, target)
        return
    os.unlink(temp)


def _file_id(path: Path | None) -> tuple[int, int] | None:
    """``path``'s (device, inode), None if it is missing: a file keeps it through a link or a rename."""
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    return None if st is None else (st.st_dev, st.st_ino)


def _os_error(path: Path, exc: OSError) -> WriterError:
    """An operating-system failure to write ``path`` (read-only file system, disk full, name too long, ...) as a
    WriterError that names the file and the reason."""
    return WriterError(f"{path}: cannot write: {exc.strerror or exc}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the files themselves are synced
        pass
    finally:
        os.close(fd)


def _as_bytes(object_id: str, data: Any) -> memoryview:
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise WriterError(f"object {object_id!r}: tensor data must be contiguous")
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    try:
        return memoryview(data).cast("B")
    except TypeError as exc:
        raise WriterError(f"object {object_id!r}: cannot write {type(data).__name__} data ({exc}); pass "
                          f"bytes, a C-contiguous buffer or a contiguous torch.Tensor") from None


def _binding_json(what: str, value: Any) -> dict[str, Any]:
    """An auxiliary binding: an object id, (object, begin, end) parts, or a JSON binding mapping."""
    if isinstance(value, str):
        return {"object": value}
    if isinstance(value, Mapping):
        return json.loads(json.dumps(value))  # a private, JSON-typed copy
    if isinstance(value, Sequence):
        return {"parts": [{"object": o, "range": [int(b), int(e)]} for o, b, e in value]}
    raise WriterError(f"{what}: a binding is an object id, a list of (object, begin, end) or a mapping")


class ArtifactWriter:
    """Writes one V3 file set at ``path`` (entry) plus ``path.part-NNNN`` continuation parts.

    ``max_file_bytes`` caps every file's total size (header + JSON + padding + payload);
    ``artifact_id`` (16 bytes) defaults to a fresh UUID4. Use as a context manager: leaving the
    block without ``finish()`` (by exception or not) aborts and removes the temp files.
    """

    def __init__(self, path: str | os.PathLike, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 artifact_id: bytes | None = None) -> None:
        self.path = Path(path)
        if not isinstance(max_file_bytes, int) or max_file_bytes <= 0:
            raise WriterError(f"{self.path}: max_file_bytes must be a positive integer, got {max_file_bytes!r}")
        if artifact_id is None:
            artifact_id = uuid.uuid4().bytes
        if not isinstance(artifact_id, (bytes, bytearray)) or len(artifact_id) != ARTIFACT_ID_BYTES:
            raise WriterError(f"{self.path}: artifact_id must be {ARTIFACT_ID_BYTES} bytes")
        self.max_file_bytes = max_file_bytes
        self._artifact_id = bytes(artifact_id)
        self._state = "declaring"
        self._components: dict[str, dict[str, Any]] = {}
        self._objects: list[_Object] = []
        self._index: dict[str, _Object] = {}
        self._bindings: dict[str, dict[str, Any]] = {}
        self._uses: list[dict[str, Any]] = []
        self._metadata: dict[str, Any] | None = None
        self._provenance: dict[str, Any] | None = None
        self._files: list[_File] = []
        self._json_bytes = 0
        self._cursor = 0

    @property
    def artifact_id(self) -> str:
        return self._artifact_id.hex()

    # -- phase 1: declare ----------------------------------------------------------------------------
    def _declaring(self, what: str) -> None:
        if self._state != "declaring":
            raise WriterError(f"{self.path}: {what} after begin_payload(); the directory is frozen")

    def add_component(self, id: str, config: Mapping, *, target: str | None = None,
                      resources: Mapping[str, str] | None = None, proposal: Mapping | None = None) -> None:
        self._declaring("add_component")
        if id in self._components:
            raise WriterError(f"{self.path}: component {id!r} declared twice")
        rec: dict[str, Any] = {"config": dict(config)}
        if target is not None:
            rec["target"] = target
        if resources:
            rec["resources"] = dict(resources)
        if proposal is not None:
            rec["proposal"] = dict(proposal)
        self._components[id] = rec

    def _add_object(self, obj: _Object) -> None:
        if obj.id in self._index:
            raise WriterError(f"{self.path}: object {obj.id!r} declared twice")
        self._objects.append(obj)
        self._index[obj.id] = obj

    def declare_tensor(self, id: str, shape: tuple[int, ...], format: str) -> None:
        """A tensor object in ``format``'s layout (raw formats ``contiguous_le_v1``; a quantized format its
        own; the caller writes the encoded bytes)."""
        self._declaring("declare_tensor")
        shape = tuple(shape)
        if len(shape) > MAX_RANK or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                            for d in shape):
            raise WriterError(f"{self.path}: object {id!r} shape {list(shape)} must be at most {MAX_RANK} "
                              f"positive integers")
        info = FORMATS.get(format)
        layout = info.layouts[0] if info is not None else LAYOUT_CONTIGUOUS
        nbytes = encoded_size(format, layout, shape, object_id=id)  # rejects unknown / unloadable formats
        self._add_object(_Object(id, "tensor", nbytes, shape=shape, format=format, layout=layout))

    def declare_resource(self, id: str, nbytes: int) -> None:
        self._declaring("declare_resource")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise WriterError(f"{self.path}: resource {id!r} must have a positive size, got {nbytes!r}")
        self._add_object(_Object(id, "resource", nbytes))

    def _add_binding(self, name: str, rec: dict[str, Any]) -> None:
        self._declaring("bind")
        if name in self._bindings:
            raise WriterError(f"{self.path}: parameter {name!r} bound twice")
        self._bindings[name] = rec

    def bind(self, name: str, object_id: str) -> None:
        self._add_binding(name, {"object": object_id})

    def bind_parts(self, name: str, parts: Sequence[tuple[str, int, int]]) -> None:
        self._add_binding(name, {"parts": [{"object": o, "range": [int(b), int(e)]} for o, b, e in parts]})

    def add_use(self, parameter: str, input: str, activation_policy: str | None = None,
                auxiliaries: Mapping | None = None) -> None:
        self._declaring("add_use")
        rec: dict[str, Any] = {"parameter": parameter, "input": input}
        if activation_policy is not None:
            rec["activation_policy"] = activation_policy
        if auxiliaries:
            rec["auxiliaries"] = {role: _binding_json(f"use {parameter!r} auxiliary {role!r}", b)
                                  for role, b in auxiliaries.items()}
        self._uses.append(rec)

    def set_metadata(self, metadata: Mapping) -> None:
        self._declaring("set_metadata")
        self._metadata = dict(metadata)

    def set_provenance(self, provenance: Mapping) -> None:
        self._declaring("set_provenance")
        self._provenance = dict(provenance)

    # -- layout --------------------------------------------------------------------------------------
    def _render(self, sizes: Sequence[int], final: bool) -> bytes:
        files = [{"path": None if i == 0 else part_file_name(self.path.name, i), "payload_bytes": n}
                 for i, n in enumerate(sizes)]
        root: dict[str, Any] = {
            "components": self._components,
            "objects": [o.record(checksum_string(o.hasher.hexdigest()) if final else CHECKSUM_PLACEHOLDER)
                        for o in self._objects],
            "bindings": self._bindings,
            "uses": self._uses,
            "files": files,
        }
        if self._metadata is not None:
            root["metadata"] = self._metadata
        if self._provenance is not None:
            root["provenance"] = self._provenance
        try:
            return json.dumps(root, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
        except (TypeError, ValueError, UnicodeEncodeError) as exc:
            raise SchemaError(f"{self.path}: the directory cannot be written as JSON: {exc}") from None

    def _split(self, total: int, payload_start: int) -> list[int]:
        """Per-file payload sizes under the cap (entry first); see docs/artifact-v3.md, "Sharding"."""
        limit = self.max_file_bytes
        if payload_start + total <= limit:
            return [total]
        entry_cap = (limit - payload_start) // PAYLOAD_ALIGN * PAYLOAD_ALIGN
        part_cap = (limit - PART_PAYLOAD_START) // PAYLOAD_ALIGN * PAYLOAD_ALIGN
        if entry_cap <= 0 or part_cap <= 0:
            raise WriterError(f"{self.path}: max_file_bytes={limit} cannot hold a payload page after the "
                              f"{payload_start}-byte entry prefix (header + JSON)")
        sizes = [entry_cap]
        rest = total - entry_cap
        while rest > 0:
            sizes.append(min(part_cap, rest))
            rest -= sizes[-1]
        return sizes

    def _layout(self) -> tuple[bytes, list[int]]:
        pos = 0
        for obj in self._objects:
            obj.offset = align_up(pos, TENSOR_ALIGN if obj.kind == "tensor" else RESOURCE_ALIGN)
            pos = obj.offset + obj.nbytes
        total = pos
        # The JSON lists the file split and the split depends on the JSON's length: iterate. The
        # payload start only grows, so this ends; a JSON that shrank below it is padded with spaces
        # (trailing whitespace is legal and counted in json_bytes).
        start = PAYLOAD_ALIGN
        while True:
            sizes = self._split(total, start)
            text = self._render(sizes, final=False)
            need = align_up(HEADER_BYTES + len(text), PAYLOAD_ALIGN)
            if need > start:
                start = need
                continue
            if need < start:
                text += b" " * (start - HEADER_BYTES - len(text))
            return text, sizes

    # -- phase 2: payload ----------------------------------------------------------------------------
    def begin_payload(self) -> None:
        """Freeze and validate the directory, lay out files, create the temp files."""
        self._declaring("begin_payload")
        if not self._objects:
            raise SchemaError(f"{self.path}: an artifact needs at least one object")
        text, sizes = self._layout()
        parse_directory(text, path=self.path)  # the reader's own checks, before any byte is written
        self._json_bytes = len(text)
        entry_start = align_up(HEADER_BYTES + len(text), PAYLOAD_ALIGN)
        files: list[_File] = []
        begin = 0
        for i, n in enumerate(sizes):
            target = self.path if i == 0 else self.path.with_name(part_file_name(self.path.name, i))
            files.append(_File(target, entry_start if i == 0 else PART_PAYLOAD_START, begin, n))
            begin += n
        for f in files:
            if os.path.lexists(f.target):
                raise TargetExistsError(f"{f.target}: already exists; the writer never overwrites")
        self._files = files
        self._state = "writing"
        mask = os.umask(0)  # mkstemp creates 0600 files; publish with the usual umask-derived mode
        os.umask(mask)
        try:
            for i, f in enumerate(self._files):
                fd, name = tempfile.mkstemp(dir=f.target.parent, prefix=f".{f.target.name}.", suffix=".tmp")
                f.fd, f.temp = fd, Path(name)
                os.fchmod(fd, 0o666 & ~mask)
                os.ftruncate(fd, f.length)  # holes read as zero: gaps and padding need no writes
                if i == 0:
                    header = EntryHeader(len(text), self._artifact_id).pack()
                    self._pwrite_all(fd, header + text, 0, f.temp)
                else:
                    self._pwrite_all(fd, PartHeader(i, self._artifact_id).pack(), 0, f.temp)
        except OSError as exc:
            self.abort()
            raise _os_error(f.target, exc) from None
        except BaseException:
            self.abort()
            raise

    @staticmethod
    def _pwrite_all(fd: int, data, offset: int, path: Path) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as exc:
                raise _os_error(path, exc) from None
            if n <= 0:
                raise WriterError(f"{path}: write made no progress")
            view, offset = view[n:], offset + n

    def write(self, object_id: str, data: Any) -> None:
        """Append the next bytes of ``object_id`` (the first incomplete object, in declaration order)."""
        if self._state != "writing":
            raise WriterError(f"{self.path}: write() needs begin_payload() first (state: {self._state})")
        if self._cursor >= len(self._objects):
            raise WriterError(f"{self.path}: object {object_id!r}: every object is already complete")
        obj = self._objects[self._cursor]
        if object_id != obj.id:
            if object_id not in self._index:
                raise WriterError(f"{self.path}: write to undeclared object {object_id!r}")
            state = "already complete" if self._index[object_id].written == self._index[object_id].nbytes \
                else "not next"
            raise WriterError(f"{self.path}: object {object_id!r} is {state}; objects are written in declaration "
                              f"order and the next is {obj.id!r} ({obj.written}/{obj.nbytes} bytes written)")
        view = _as_bytes(object_id, data)
        if obj.written + len(view) > obj.nbytes:
            raise WriterError(f"{self.path}: object {object_id!r} is {obj.nbytes} bytes; writing {len(view)} "
                              f"more after {obj.written} overflows it")
        try:
            self._write_logical(obj.offset + obj.written, view)
        except BaseException:
            self.abort()
            raise
        obj.hasher.update(view)
        obj.written += len(view)
        if obj.written == obj.nbytes:
            self._cursor += 1

    def _write_logical(self, pos: int, view: memoryview) -> None:
        end = pos + len(view)
        for f in self._files:
            lo, hi = max(pos, f.payload_begin), min(end, f.payload_begin + f.payload_bytes)
            if lo < hi:
                self._pwrite_all(f.fd, view[lo - pos:hi - pos], f.payload_start + lo - f.payload_begin, f.temp)

    def finish(self) -> list[Path]:
        """Fill checksums, fsync, publish parts then the entry; returns the files, entry first."""
        if self._state != "writing":
            raise WriterError(f"{self.path}: finish() needs begin_payload() first (state: {self._state})")
        if self._cursor < len(self._objects):
            obj = self._objects[self._cursor]
            raise WriterError(f"{self.path}: object {obj.id!r} is incomplete ({obj.written}/{obj.nbytes} bytes "
                              f"written); nothing was published")
        published: list[Path] = []
        # The file being published, with its temp's identity: linked or renamed, perhaps, and not yet in published.
        in_flight: tuple[_File, tuple[int, int] | None] | None = None
        try:
            text = self._render([f.payload_bytes for f in self._files], final=True)
            # Checksums are fixed width, so the final JSON fits exactly where the placeholder was.
            text += b" " * (self._json_bytes - len(text))
            if len(text) != self._json_bytes:
                raise WriterError(f"{self.path}: internal error: the final directory changed length")
            entry = self._files[0]
            self._pwrite_all(entry.fd, text, HEADER_BYTES, entry.temp)
            for f in self._files:
                os.fsync(f.fd)
                os.close(f.fd)
                f.fd = None
            for f in self._files[1:] + self._files[:1]:  # parts first: an entry never lacks its parts
                in_flight = (f, _file_id(f.temp))
                _publish_file(f.temp, f.target)
                published.append(f.target)
                f.temp, in_flight = None, None
            _fsync_dir(self.path.parent)
        except BaseException as exc:
            # Published just before the interruption (linked, or renamed, even with the temp's name already gone):
            # the target is our file if it is still our temp's inode; someone else's file never is.
            if in_flight is not None and in_flight[1] is not None and _file_id(in_flight[0].target) == in_flight[1]:
                published.append(in_flight[0].target)
            for target in published:  # ours: _publish_file never replaces a file
                try:
                    os.unlink(target)
                except FileNotFoundError:
                    pass
            self.abort()
            if isinstance(exc, OSError):
                raise _os_error(in_flight[0].target if in_flight is not None else self.path, exc) from None
            raise
        self._state = "finished"
        return [f.target for f in self._files]

    def abort(self) -> None:
        """Close and remove every temp file; idempotent; a no-op after a successful finish()."""
        if self._state == "finished":
            return
        for f in self._files:
            if f.fd is not None:
                try:
                    os.close(f.fd)
                except OSError:
                    pass
                f.fd = None
            if f.temp is not None:
                try:
                    os.unlink(f.temp)
                except FileNotFoundError:
                    pass
                f.temp = None
        self._state = "aborted"

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._state != "finished":
            self.abort()
