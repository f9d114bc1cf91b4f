"""``ninfer-convert verify``: re-read every object of an artifact and check its checksum.

Invariant: :func:`verify_artifact` returns only after every object (tensor and resource) of the
directory was read in full from its file(s) and hashed to the checksum its record states; the
first object that fails raises :class:`VerificationError` naming it. Opening the artifact runs the
reader's framing and directory checks first, so a malformed file fails before any payload read.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ninfer.artifact import ArtifactReader
from ninfer.artifact.errors import ArtifactError
from ninfer.errors import NInferError
from tqdm import tqdm


class VerificationError(NInferError):
    """An artifact failed verification (checksum mismatch or unreadable object)."""


@dataclass(frozen=True)
class VerifyReport:
    """What was checked: ``files`` of the set, ``objects`` (``tensors`` + ``resources``) and their
    total ``bytes``."""

    path: Path
    files: int
    objects: int
    tensors: int
    resources: int
    bytes: int


def verify_artifact(path: str | Path, *, progress: bool | None = None) -> VerifyReport:
    """Check every object checksum of the artifact whose entry file is ``path``.

    ``progress`` shows a byte progress bar on stderr (``None``: only when stderr is a terminal).
    """
    path = Path(path)
    with ArtifactReader.open(path) as reader:
        directory = reader.directory
        total = sum(o.bytes for o in directory.objects)
        show = sys.stderr.isatty() if progress is None else progress
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                  disable=not show, desc=f"verify {path.name}") as bar:
            for obj in directory.objects:
                try:
                    reader.verify_object(obj.id)  # streams in bounded chunks
                except ArtifactError as exc:
                    raise VerificationError(
                        f"{str(path)!r}: object {obj.id!r} failed verification: {exc}") from exc
                bar.update(obj.bytes)
    tensors = sum(1 for o in directory.objects if o.is_tensor)
    return VerifyReport(path, len(directory.files), len(directory.objects), tensors,
                        len(directory.objects) - tensors, total)
