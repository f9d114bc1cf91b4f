"""ArtifactReader: framing and directory checks, lazy part opening, bounded positional reads.

Invariants:
- ``ArtifactReader.open`` reads only the entry file: header, JSON directory (fully validated by
  :func:`~ninfer.artifact.directory.parse_directory`), the zero gap before the payload and the
  entry's exact length. Nothing of the payload is read.
- A continuation part is opened the first time a read touches its payload range, and only then
  are its header (magic, version, part index, artifact id), zero padding and exact length checked;
  ``opened_files`` lists the files opened so far, so a caller can prove that unselected parts were
  never touched.
- Reads use ``pread``-style positional I/O: no shared file position, so concurrent reads are safe.
- ``read_object`` verifies the object's xxh64 checksum unless told not to.
"""

from __future__ import annotations

import bisect
import os
import stat
import threading
from pathlib import Path

import xxhash

from ninfer.artifact.directory import ComponentRecord, Directory, ObjectRecord, parse_directory
from ninfer.artifact.errors import (
    ArtifactIdMismatchError,
    ArtifactNotFoundError,
    ChecksumMismatchError,
    FileLengthError,
    FramingError,
    MissingComponentError,
    MissingPartError,
    ObjectRangeError,
    ReaderClosedError,
    TruncatedFileError,
    UnknownLayoutError,
    UnknownReferenceError,
)
from ninfer.artifact.format import (
    HEADER_BYTES,
    PART_PAYLOAD_START,
    RESOURCE_ENCODING,
    EntryHeader,
    PartHeader,
    checksum_string,
)

DEFAULT_CHUNK_BYTES = 64 << 20   # bounded read size: large enough for throughput, small for memory


# O_NONBLOCK: opening a FIFO must not wait for a writer (regular files ignore the flag).
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def _open_regular(path: Path) -> int | str:
    """A read-only descriptor of ``path`` if it is a regular file; else why not, for the caller's error:
    "missing", "a directory", "not a regular file" (a FIFO, a device) or the system's reason (a symbolic-link loop,
    a name too long, no permission)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except IsADirectoryError:
        return "a directory"
    except OSError as exc:
        return f"cannot be opened: {exc.strerror or exc}"
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        return "a directory" if stat.S_ISDIR(mode) else "not a regular file"
    return fd


def _pread(fd: int, length: int, offset: int) -> bytes:
    out = bytearray(length)
    got = _preadinto(fd, memoryview(out), offset)
    return bytes(out[:got])


def _preadinto(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; returns the bytes read (short only at end of file)."""
    total = 0
    while total < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[total:]], offset + total)
        else:  # platforms without preadv: one extra copy
            chunk = os.pread(fd, len(buf) - total, offset + total)
            n = len(chunk)
            buf[total:total + n] = chunk
        if n == 0:
            break
        total += n
    return total


class ArtifactReader:
    """An open V3 file set. Build with :meth:`open`; use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._opened: list[Path] = []
        self._closed = False
        fd = _open_regular(self.path)
        if isinstance(fd, str):
            raise ArtifactNotFoundError(f"{self.path}: no such artifact file ({fd})")
        try:
            self._open_entry(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fds[0] = fd
        self._opened.append(self.path)

    @classmethod
    def open(cls, path: str | os.PathLike) -> ArtifactReader:
        """Open and validate the entry file at ``path`` (parts stay closed until read)."""
        return cls(path)

    def _open_entry(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        header = EntryHeader.unpack(_pread(fd, HEADER_BYTES, 0), self.path)
        if size < HEADER_BYTES + header.json_bytes:
            raise TruncatedFileError(f"{self.path}: {size} bytes, but the header declares a "
                                     f"{header.json_bytes}-byte JSON directory")
        self._header = header
        self.directory: Directory = parse_directory(_pread(fd, header.json_bytes, HEADER_BYTES), path=self.path)
        start = header.payload_start
        want = start + self.directory.files[0].payload_bytes
        if size < want:
            raise TruncatedFileError(f"{self.path}: {size} bytes, but header and file table need {want}")
        if size > want:
            raise FileLengthError(f"{self.path}: {size} bytes, {size - want} more than header and file "
                                  f"table allow ({want})")
        gap_at = HEADER_BYTES + header.json_bytes
        if any(_pread(fd, start - gap_at, gap_at)):
            raise FramingError(f"{self.path}: the padding between JSON and payload is not zero")
        self._starts = [start] + [PART_PAYLOAD_START] * (len(self.directory.files) - 1)
        self._begins = [f.payload_begin for f in self.directory.files]

    # -- identity and records ---------------------------------------------------------------------
    @property
    def artifact_id(self) -> str:
        """The file set's 16-byte id as 32 lowercase hex digits."""
        return self._header.artifact_id.hex()

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file of the set, in file-table order (entry first); parts may not exist."""
        return (self.path,) + tuple(self.path.parent / f.path for f in self.directory.files[1:])

    @property
    def opened_files(self) -> tuple[Path, ...]:
        """The files opened so far, in opening order (the entry is always first)."""
        with self._lock:
            return tuple(self._opened)

    def component(self, id: str) -> ComponentRecord:
        try:
            return self.directory.components[id]
        except KeyError:
            have = ", ".join(self.directory.components)
            raise MissingComponentError(
                f"{self.path}: component {id!r} is not in this artifact (it provides: {have})") from None

    def object(self, id: str) -> ObjectRecord:
        try:
            return self.directory.object_index[id]
        except KeyError:
            raise UnknownReferenceError(f"{self.path}: no object {id!r}") from None

    # -- reads ------------------------------------------------------------------------------------
    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with logical payload bytes ``[offset, offset + len(buf))``, across files."""
        buf = memoryview(buf).cast("B")
        end = offset + len(buf)
        if offset < 0 or end > self.directory.payload_bytes:
            raise ObjectRangeError(f"{self.path}: read [{offset}, {end}) is outside the logical payload "
                                   f"({self.directory.payload_bytes} bytes)")
        pos = offset
        i = bisect.bisect_right(self._begins, offset) - 1
        while pos < end:
            rec = self.directory.files[i]
            n = min(end, rec.payload_end) - pos
            if n > 0:
                fd = self._fd(i)
                got = _preadinto(fd, buf[pos - offset:pos - offset + n], self._starts[i] + pos - rec.payload_begin)
                if got != n:  # the file shrank after it was opened and checked
                    raise TruncatedFileError(f"{self.files[i]}: ended early while reading payload bytes "
                                             f"[{pos}, {pos + n})")
                pos += n
            i += 1

    def read_range(self, offset: int, length: int) -> bytes:
        """Logical payload bytes ``[offset, offset + length)`` (unverified)."""
        out = bytearray(length)
        self.read_into(offset, memoryview(out))
        return bytes(out)

    def read_object(self, id: str, *, verify: bool = True) -> bytes:
        """An object's encoded bytes; with ``verify`` the xxh64 checksum must match."""
        obj = self.object(id)
        data = self.read_range(obj.offset, obj.bytes)
        if verify:
            self.check_checksum(obj, xxhash.xxh64_hexdigest(data))
        return data

    def verify_object(self, id: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        """Stream an object in bounded chunks and check its checksum (no full copy in memory)."""
        obj = self.object(id)
        h = xxhash.xxh64()
        buf = memoryview(bytearray(min(chunk_bytes, obj.bytes)))
        for pos in range(obj.offset, obj.end, len(buf)):
            view = buf[:min(len(buf), obj.end - pos)]
            self.read_into(pos, view)
            h.update(view)
        self.check_checksum(obj, h.hexdigest())

    def check_checksum(self, obj: ObjectRecord, hexdigest: str) -> None:
        """Raise :class:`ChecksumMismatchError` naming the object and its files unless they agree."""
        got = checksum_string(hexdigest)
        if got != obj.checksum:
            raise ChecksumMismatchError(
                f"{self.path}: object {obj.id!r} (payload bytes [{obj.offset}, {obj.end}) in "
                f"{', '.join(str(p) for p in self.files_of(obj))}) hashes to {got}, its record says "
                f"{obj.checksum}")

    def files_of(self, obj: ObjectRecord) -> tuple[Path, ...]:
        """The files holding an object's bytes (objects may straddle files)."""
        return tuple(self.files[f.index] for f in self.directory.files
                     if f.payload_begin < obj.end and obj.offset < f.payload_end)

    def resource(self, component: str, role: str) -> bytes | None:
        """A component's frontend resource by role (checksum verified); None if it has none."""
        oid = self.component(component).resources.get(role)
        if oid is None:
            return None
        obj = self.object(oid)
        if obj.encoding != RESOURCE_ENCODING:
            raise UnknownLayoutError(f"{self.path}: resource object {oid!r} has unknown encoding "
                                     f"{obj.encoding!r} (known: {RESOURCE_ENCODING})")
        return self.read_object(oid)

    # -- files --------------------------------------------------------------------------------------
    def _fd(self, index: int) -> int:
        with self._lock:
            if self._closed:
                raise ReaderClosedError(f"{self.path}: the reader is closed")
            fd = self._fds.get(index)
            if fd is None:
                fd = self._open_part(index)
                self._fds[index] = fd
                self._opened.append(self.files[index])
            return fd

    def _open_part(self, index: int) -> int:
        path = self.files[index]
        rec = self.directory.files[index]
        fd = _open_regular(path)
        if isinstance(fd, str):
            what = fd if fd.startswith("cannot") else f"is {fd}"
            raise MissingPartError(f"{self.path}: continuation part {index} ({path}) {what}")
        try:
            size = os.fstat(fd).st_size
            header = PartHeader.unpack(_pread(fd, HEADER_BYTES, 0), path)
            if header.artifact_id != self._header.artifact_id:
                raise ArtifactIdMismatchError(
                    f"{path}: part belongs to artifact {header.artifact_id.hex()}, but entry {self.path} "
                    f"is artifact {self.artifact_id}")
            if header.part_index != index:
                raise ArtifactIdMismatchError(f"{path}: header says part {header.part_index}, but the file "
                                              f"table lists it as part {index}")
            want = PART_PAYLOAD_START + rec.payload_bytes
            if size < want:
                raise TruncatedFileError(f"{path}: {size} bytes, but the file table needs {want}")
            if size > want:
                raise FileLengthError(f"{path}: {size} bytes, {size - want} more than the file table allows")
            if any(_pread(fd, PART_PAYLOAD_START - HEADER_BYTES, HEADER_BYTES)):
                raise FramingError(f"{path}: the padding between header and payload is not zero")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        """Close every open file; idempotent. Later reads raise :class:`ReaderClosedError`."""
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> ArtifactReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten reader must not leak descriptors
        if getattr(self, "_fds", None):
            self.close()

    def __repr__(self) -> str:
        return f"ArtifactReader({str(self.path)!r}, artifact_id={self.artifact_id})"
