"""Reading a local Hugging Face checkpoint folder: config, safetensors headers, tensor locations.

:func:`open_checkpoint` reads ``config.json`` and the header of every weight file; it never reads
tensor data. The resulting :class:`SourceCheckpoint` lists each tensor (name, shape, safetensors
dtype) and where its raw little-endian bytes lie, so the converter can copy them verbatim.

Invariants of a :class:`SourceCheckpoint`:

- ``config`` is a JSON object whose ``architectures`` is a non-empty list of strings;
- every tensor name occurs in exactly one weight file; with ``model.safetensors.index.json`` the
  index's ``weight_map`` and the shard headers name exactly the same tensors, file for file;
- every location lies inside its file's data section, and for dtypes of known width its byte count
  equals ``prod(shape) * itemsize``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ninfer.artifact.source_mapping import SourceTensor
from ninfer.conversion.errors import SourceError

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

# Bytes per element of the safetensors dtypes; a dtype outside this table is listed (the plan may
# ignore it) but its byte count cannot be checked and it cannot be imported.
DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType({
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
})

# safetensors itself refuses headers above 100 MB; a larger length means a corrupt or foreign file.
_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class SourceFile:
    """A file of the source folder that the conversion reads: ``name`` relative to the folder."""

    name: str
    path: Path
    size: int


@dataclass(frozen=True)
class TensorLocation:
    """The raw bytes of one tensor: ``nbytes`` bytes at absolute ``offset`` of weight file ``file``."""

    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SourceCheckpoint:
    """A Hugging Face checkpoint folder, read up to (and excluding) tensor data.

    ``tensors`` and ``locations`` have the same keys, ordered by weight file then by byte offset.
    ``index`` is the sharding index when the folder has one.
    """

    folder: Path
    config: Mapping[str, Any]
    weight_files: tuple[SourceFile, ...]
    index: SourceFile | None
    tensors: Mapping[str, SourceTensor]
    locations: Mapping[str, TensorLocation]

    @property
    def architecture(self) -> str:
        """``architectures[0]`` of ``config.json``: selects the plugin's source mapping."""
        return self.config["architectures"][0]

    def weight_file(self, name: str) -> SourceFile:
        for f in self.weight_files:
            if f.name == name:
                return f
        raise KeyError(name)


def open_checkpoint(folder: str | Path) -> SourceCheckpoint:
    """Read ``config.json`` and every weight file header of ``folder`` (no tensor data)."""
    folder = Path(folder)
    try:
        is_dir = folder.is_dir()
    except OSError as exc:   # a name too long for the file system, say
        raise SourceError(f"source checkpoint folder {str(folder)!r}: {exc.strerror or exc}") from None
    if not is_dir:
        raise SourceError(f"source checkpoint folder {str(folder)!r} does not exist or is not a folder")
    config = _read_config(folder)
    index_file, shard_names, index_map = _weight_file_names(folder)

    weight_files: list[SourceFile] = []
    tensors: dict[str, SourceTensor] = {}
    locations: dict[str, TensorLocation] = {}
    owner: dict[str, str] = {}
    for name in shard_names:
        path = folder / name
        entries = read_safetensors_header(path)
        weight_files.append(SourceFile(name, path, path.stat().st_size))
        for tensor, location in entries:
            if tensor.name in owner:
                raise SourceError(
                    f"tensor {tensor.name!r} is stored twice in {str(folder)!r}: in {owner[tensor.name]!r} "
                    f"and in {name!r}")
            owner[tensor.name] = name
            tensors[tensor.name] = tensor
            locations[tensor.name] = location

    if index_map is not None:
        for tensor_name, file_name in index_map.items():
            found = owner.get(tensor_name)
            if found is None:
                raise SourceError(
                    f"{INDEX_NAME} in {str(folder)!r} maps tensor {tensor_name!r} to {file_name!r}, "
                    f"but no weight file contains it")
            if found != file_name:
                raise SourceError(
                    f"{INDEX_NAME} in {str(folder)!r} maps tensor {tensor_name!r} to {file_name!r}, "
                    f"but it is stored in {found!r}")
        for tensor_name, file_name in owner.items():
            if tensor_name not in index_map:
                raise SourceError(
                    f"tensor {tensor_name!r} of {file_name!r} in {str(folder)!r} is missing from {INDEX_NAME}")

    return SourceCheckpoint(
        folder=folder,
        config=MappingProxyType(config),
        weight_files=tuple(weight_files),
        index=index_file,
        tensors=MappingProxyType(tensors),
        locations=MappingProxyType(locations),
    )


def read_safetensors_header(path: Path) -> list[tuple[SourceTensor, TensorLocation]]:
    """Parse a safetensors header: 8-byte little-endian length, then a JSON object of tensors.

    Returns the tensors ordered by byte offset, each with its absolute location in the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise SourceError(f"{str(path)!r} is not a safetensors file: shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise SourceError(f"{str(path)!r} is not a valid safetensors file: header length {header_len} "
                              f"does not fit the file ({size} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"{str(path)!r} has an unreadable safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise SourceError(f"{str(path)!r} has a safetensors header that is not a JSON object")

    data_start = 8 + header_len
    data_len = size - data_start
    entries: list[tuple[SourceTensor, TensorLocation]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries.append(_parse_entry(path, name, info, data_start, data_len))
    entries.sort(key=lambda e: (e[1].offset, e[1].nbytes))
    # As safetensors itself requires: the tensors tile the data section, without gaps, overlaps or trailing bytes
    # (overlapping ranges would give one tensor another's bytes without a word).
    at = 0
    for tensor, loc in entries:
        start = loc.offset - data_start
        if start != at:
            raise SourceError(f"tensor {tensor.name!r} in {str(path)!r}: its data starts at byte {start} of the data "
                              f"section where the previous tensor ends at {at}: a safetensors file's tensors are "
                              f"contiguous, without gaps or overlaps")
        at = start + loc.nbytes
    if at != data_len:
        raise SourceError(f"{str(path)!r}: {data_len - at} bytes follow the last tensor's data; a safetensors file "
                          f"ends where its last tensor ends")
    return entries


def _parse_entry(path: Path, name: str, info: Any, data_start: int, data_len: int
                 ) -> tuple[SourceTensor, TensorLocation]:
    where = f"tensor {name!r} in {str(path)!r}"
    if not isinstance(info, dict):
        raise SourceError(f"{where}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise SourceError(f"{where}: header has no dtype string")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SourceError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        raise SourceError(f"{where}: data_offsets {offsets!r} do not lie inside the data section "
                          f"({data_len} bytes)")
    nbytes = offsets[1] - offsets[0]
    itemsize = DTYPE_ITEMSIZE.get(dtype)
    if itemsize is not None and nbytes != math.prod(shape) * itemsize:
        raise SourceError(f"{where}: {nbytes} bytes do not match shape {shape} of dtype {dtype}")
    return (SourceTensor(name, tuple(shape), dtype),
            TensorLocation(path.name, data_start + offsets[0], nbytes))


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise SourceError(f"source checkpoint folder {str(folder)!r} has no {CONFIG_NAME}")
    config = _read_json(path)
    if not isinstance(config, dict):
        raise SourceError(f"{str(path)!r} is not a JSON object")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
        raise SourceError(f"{str(path)!r} has no non-empty 'architectures' list; it names the architecture "
                          f"whose source mapping converts the checkpoint")
    return config


def _weight_file_names(folder: Path) -> tuple[SourceFile | None, list[str], dict[str, str] | None]:
    """The weight files to read: those of the index when present, else every ``*.safetensors``.

    The index wins over a directory listing because some releases ship a consolidated file beside
    the shards; reading both would duplicate every tensor.
    """
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{str(index_path)!r} has no non-empty 'weight_map' of tensor name -> file name")
        wrong = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
        if wrong is not None:
            raise SourceError(f"{str(index_path)!r}: 'weight_map' maps {wrong!r} to {weight_map[wrong]!r}, "
                              f"not to a file name")
        names: list[str] = []
        for file_name in weight_map.values():
            if file_name not in names:
                names.append(file_name)
        for file_name in names:
            if Path(file_name).name != file_name or not (folder / file_name).is_file():
                raise SourceError(f"{INDEX_NAME} in {str(folder)!r} names weight file {file_name!r}, "
                                  f"which is not a file of that folder")
        index_file = SourceFile(INDEX_NAME, index_path, index_path.stat().st_size)
        return index_file, sorted(names), dict(weight_map)

    names = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    if not names:
        other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(other)}; only safetensors weights are read)" if other else ""
        raise SourceError(f"source checkpoint folder {str(folder)!r} has no *.safetensors weights{hint}")
    return None, names, None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"{str(path)!r} is not valid JSON: {exc}") from None
