"""Resolve what a user names as MODEL into a ``.ninfer`` artifact path.

- a ``.ninfer`` file: used as is;
- a Hugging Face checkpoint folder (has ``config.json``): converted once (:mod:`ninfer.conversion`) into
  the cache and reused while the folder's contents are unchanged;
- nothing: the default model a plugin ships (``ninfer_default_models`` hook), converted the same way.

A conversion says so on stderr first (one line naming the model and the cache path; ``quiet`` leaves it out),
since the first run with the default model spends that time converting, not loading.

The cache key is a digest of every file's name, size and bytes in the source folder, so a changed
source is rebuilt and an unchanged one is never converted twice. Conversion writes to a temporary
name and publishes atomically (the writer never overwrites), so concurrent first runs are safe.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ninfer.errors import NInferError


class ModelSourceError(NInferError):
    """The named model is neither an artifact nor a checkpoint folder, or cannot be converted."""


@dataclass(frozen=True)
class DefaultModel:
    """A Hugging Face folder shipped inside a plugin distribution."""

    name: str
    source: Path
    description: str = ""


def cache_dir() -> Path:
    """``$NINFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/ninfer``, else ``~/.cache/ninfer``."""
    explicit = os.environ.get("NINFER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ninfer"


def source_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        h.update(rel.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:20]


def default_model(registry=None) -> DefaultModel:
    from ninfer.plugins import get_registry

    models = list((registry or get_registry()).default_models.values())
    if not models:
        raise ModelSourceError("no model was named and no installed plugin ships a default model; "
                               "name a .ninfer artifact or a Hugging Face folder, or install an architecture "
                               "plugin that ships one ('ninfer plugins' lists each plugin's default_models)")
    return models[0]


def resolve_model(model: str | os.PathLike | None, *, registry=None, progress: bool = False,
                  quiet: bool = False) -> Path:
    """The artifact path for ``model`` (see the module docstring), converting into the cache if needed (saying
    so on stderr unless ``quiet``)."""
    if model is None:
        chosen = default_model(registry)
        return _converted(chosen.source, chosen.name, f"the default model {chosen.name}", registry=registry,
                          progress=progress, quiet=quiet)
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is a folder without config.json: not a Hugging Face checkpoint")
        return _converted(path, path.name, str(path), registry=registry, progress=progress, quiet=quiet)
    if path.is_file():
        return path
    raise ModelSourceError(f"model {str(model)!r} not found: give a .ninfer artifact or a Hugging Face folder")


def _converted(source: Path, name: str, what: str, *, registry, progress: bool, quiet: bool) -> Path:
    target_dir = cache_dir() / "artifacts"
    target = target_dir / f"{name}-{source_digest(source)}.ninfer"
    if target.is_file():
        return target
    from ninfer.conversion import OutputExistsError, convert  # torch and the writer: only when converting

    if not quiet:
        print(f"[ninfer] converting {what} (once) into {target}", file=sys.stderr, flush=True)
    target_dir.mkdir(parents=True, exist_ok=True)
    try:
        convert(source, target, name=name, registry=registry, progress=progress)
    except OutputExistsError:
        pass  # another process published the same conversion first: it is identical by construction
    return target
