"""The converted artifacts in the cache: where they live, how their files are named, listing and removing them.

Invariants:

- every converted artifact is ``cache_dir()/artifacts/{safe name}-{key}.ninfer`` plus its continuation parts
  (``.part-NNNN``); in-progress conversions are hidden ``.*.tmp`` files and are never listed;
- an artifact's name is the ``metadata.name`` it records (the served model name), not its file name;
- :func:`remove` deletes only files inside the artifacts folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ninfer.model_source.errors import ModelSourceError

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def cache_dir() -> Path:
    """``$NINFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/ninfer``, else ``~/.cache/ninfer``."""
    explicit = os.environ.get("NINFER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ninfer"


def artifacts_dir() -> Path:
    return cache_dir() / "artifacts"


def artifact_path(name: str, key: str) -> Path:
    """The cache path of the conversion of ``name`` keyed by ``key``: ``/`` becomes ``--`` (the hub cache's
    spelling) and any other character outside ``[A-Za-z0-9._-]`` becomes ``_``, so the file name is safe on
    every filesystem."""
    safe = _UNSAFE.sub("_", name.replace("/", "--")).lstrip(".") or "model"
    return artifacts_dir() / f"{safe}-{key}.ninfer"


@dataclass(frozen=True)
class CachedArtifact:
    """One converted artifact. ``name`` is its recorded name (None when the artifact cannot be read:
    ``problem`` says why); ``files`` are the entry and the parts that exist; ``size`` their bytes;
    ``modified`` the entry's mtime (seconds since the epoch)."""

    path: Path
    name: str | None
    files: tuple[Path, ...]
    size: int
    modified: float
    problem: str | None = None


def cached_artifacts() -> list[CachedArtifact]:
    """Every converted artifact in the cache, by name then newest first (unreadable ones last)."""
    folder = artifacts_dir()
    if not folder.is_dir():
        return []
    # A symlinked entry whose target is gone is listed too (unreadable), so that rm can remove it.
    found = [_describe(p) for p in folder.glob("*.ninfer")
             if not p.name.startswith(".") and (p.is_file() or p.is_symlink())]
    return sorted(found, key=lambda a: (a.name is None, a.name or a.path.name, -a.modified))


def _describe(path: Path) -> CachedArtifact:
    from ninfer.artifact import ArtifactError, ArtifactReader

    # Files or links, never a folder that happens to carry a part's name (rm would not remove it).
    parts = sorted(p for p in path.parent.glob(glob_escape(path.name) + ".part-*") if p.is_symlink() or not p.is_dir())
    name, problem = None, None
    try:
        with ArtifactReader.open(path) as reader:
            name = (reader.directory.metadata or {}).get("name")
            parts = [p for p in reader.files[1:] if p.is_file()]
    except (ArtifactError, OSError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    files = (path, *parts)
    return CachedArtifact(path, name, files, sum(_stat(f).st_size for f in files), _stat(path).st_mtime, problem)


def _stat(path: Path) -> os.stat_result:
    """The file's status, or its link's where the link's target is gone."""
    try:
        return path.stat()
    except OSError:
        return path.lstat()


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def named(name: str) -> list[CachedArtifact]:
    """The converted artifacts recording ``name``, newest first."""
    return sorted((a for a in cached_artifacts() if a.name == name), key=lambda a: -a.modified)


def remove(artifact: CachedArtifact) -> int:
    """Delete the artifact's files (each must lie in the artifacts folder); returns the bytes freed."""
    root = artifacts_dir().resolve()
    for f in artifact.files:
        # The folder holding the entry, not the entry's target: a symlinked entry is unlinked, never followed.
        if f.parent.resolve() != root:
            raise ModelSourceError(f"{f} is outside the cache's artifacts folder {root}; not removed")
    freed = 0
    for f in artifact.files:
        try:
            size = f.lstat().st_size
            f.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile (another rm)
        except OSError as exc:
            raise ModelSourceError(f"{f}: cannot be removed ({exc.strerror or exc}); {freed} bytes of "
                                   f"{artifact.path.name} were removed before it") from None
        freed += size
    return freed
