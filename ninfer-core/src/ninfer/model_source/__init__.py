"""Resolve what a user names as MODEL into a ``.ninfer`` artifact path. MODEL is tried as, in order:

1. an existing file: a ``.ninfer`` artifact, used as is;
2. an existing folder: a Hugging Face checkpoint (has ``config.json``), converted once into the cache;
3. the name of a default model a plugin ships (``ninfer_default_models`` hook, as ``ninfer plugins`` lists
   it), converted the same way; no MODEL at all is the first such default model. A default model may ship
   draft checkpoints (``DefaultModel.drafts``, keyed by speculative backend): asked for with ``draft=`` (the
   engine passes its ``speculative`` option), the model is converted once more with that draft as a component
   (``ninfer-convert --draft``), into an artifact of its own;
4. a Hugging Face repo id ``owner/name`` (optionally ``@revision``): its snapshot in the local hub cache
   (:mod:`ninfer.model_source.hub_cache`), else an artifact already converted from it under that name
   (so the hub download may be deleted after conversion), else downloaded, then converted once.

The converted artifact's name (``metadata.name``, the engine's ``info["name"]`` and the served model id) is the
folder's name, the default model's name or the repo id (``Qwen/Qwen3.5-9B``, as vLLM serves it).

The cache key of a plain folder is a digest of every file's name, size and bytes, so a changed folder is
rebuilt and an unchanged one is never converted twice. A hub snapshot's files are immutable for its commit, so
its key is the repo id and the commit sha, and a multi-gigabyte snapshot is not read to find its artifact.
Conversion writes to a temporary name and publishes atomically (the writer never overwrites), so concurrent
first runs are safe. A conversion or download says so on stderr first (``quiet`` leaves that out).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ninfer.model_source import store
from ninfer.model_source.errors import ModelSourceError
from ninfer.model_source.hub_cache import (
    HubRepo,
    Snapshot,
    cached_snapshot,
    download,
    hub_cache_dir,
    missing_files,
    offline,
    parse_repo_id,
    snapshot_of_folder,
)
from ninfer.model_source.store import cache_dir

__all__ = ["DefaultModel", "ModelSourceError", "cache_dir", "default_model", "resolve_model", "source_digest"]


@dataclass(frozen=True)
class DefaultModel:
    """A Hugging Face folder shipped inside a plugin distribution; ``name`` is what MODEL may say to pick it.

    ``drafts`` maps a speculative backend's name (``EngineOptions.speculative``) to a draft checkpoint folder
    shipped beside the model, in the form ``ninfer-convert --draft`` reads; a backend the model carries itself
    (e.g. an MTP layer inside the checkpoint) needs no entry."""

    name: str
    source: Path
    description: str = ""
    drafts: Mapping[str, Path] = field(default_factory=dict)


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
                  quiet: bool = False, draft: str | None = None) -> Path:
    """The artifact path for ``model`` (see the module docstring), converting into the cache (and downloading
    into the hub cache) if needed, saying so on stderr unless ``quiet``. Anything else is a ModelSourceError
    naming ``model``. ``draft``: a speculative backend's name; only a shipped default model with a draft for
    it resolves differently (to its conversion with that draft), every other MODEL ignores it."""
    if model is None:
        return _default(default_model(registry), registry=registry, progress=progress, quiet=quiet, draft=draft)
    text = os.fspath(model)
    path = Path(text)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError as exc:   # a name too long for the file system, say (a missing path is just not a file)
        raise ModelSourceError(f"model {text[:80]!r}{'...' if len(text) > 80 else ''}: not a usable path: "
                               f"{exc.strerror or exc}") from None
    if is_file:
        return path
    if is_dir:
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is a folder without config.json: not a Hugging Face checkpoint")
        snapshot = snapshot_of_folder(path)
        if snapshot is not None:
            return _from_snapshot(snapshot, registry=registry, progress=progress, quiet=quiet)
        return _converted(path, path.resolve().name, source_digest(path), str(path), registry=registry,
                          progress=progress, quiet=quiet)
    from ninfer.plugins import get_registry

    defaults = (registry or get_registry()).default_models
    if text in defaults:
        return _default(defaults[text], registry=registry, progress=progress, quiet=quiet, draft=draft)
    repo = parse_repo_id(text)
    if repo is not None:
        return _from_hub(repo, registry=registry, progress=progress, quiet=quiet)
    shipped = ", ".join(defaults) or "none installed"
    raise ModelSourceError(f"model {text!r} not found: it is no file or folder, no shipped default model "
                           f"({shipped}) and no Hugging Face repo id (owner/name)")


def _default(chosen: DefaultModel, *, registry, progress: bool, quiet: bool, draft: str | None = None) -> Path:
    folder = chosen.drafts.get(draft) if draft else None
    if folder is None:
        return _converted(chosen.source, chosen.name, source_digest(chosen.source),
                          f"the default model {chosen.name}", registry=registry, progress=progress, quiet=quiet)
    # Same public name (the served model id does not change with the drafter), its own cache key.
    key = hashlib.sha256(f"{source_digest(chosen.source)}\0{draft}\0{source_digest(folder)}".encode()).hexdigest()[:20]
    return _converted(chosen.source, chosen.name, key, f"the default model {chosen.name} with its {draft} drafter",
                      registry=registry, progress=progress, quiet=quiet, draft=folder)


def _from_hub(repo: HubRepo, *, registry, progress: bool, quiet: bool) -> Path:
    cache = hub_cache_dir()
    snapshot = cached_snapshot(repo, cache)
    lacking = missing_files(snapshot.folder) if snapshot is not None else None
    if snapshot is not None and not lacking:
        return _from_snapshot(snapshot, registry=registry, progress=progress, quiet=quiet)
    converted = store.named(repo.repo_id) if repo.revision is None else []
    if converted:
        if not quiet:
            print(f"[ninfer] {repo} is not in the Hugging Face cache at {cache}; using its converted artifact "
                  f"{converted[0].path}", file=sys.stderr, flush=True)
        return converted[0].path
    if snapshot is not None and offline():
        raise ModelSourceError(f"{repo}: the snapshot {snapshot.folder} lacks {', '.join(lacking)} and "
                               f"HF_HUB_OFFLINE is set, so they cannot be downloaded")
    return _from_snapshot(download(repo, cache, quiet=quiet), registry=registry, progress=progress, quiet=quiet)


def _from_snapshot(snapshot: Snapshot, *, registry, progress: bool, quiet: bool) -> Path:
    key = hashlib.sha256(f"hf-hub\0{snapshot.repo_id}\0{snapshot.commit}".encode()).hexdigest()[:20]
    return _converted(snapshot.folder, snapshot.repo_id, key, f"{snapshot.repo_id} (commit {snapshot.commit[:12]})",
                      registry=registry, progress=progress, quiet=quiet)


def _converted(source: Path, name: str, key: str, what: str, *, registry, progress: bool, quiet: bool,
               draft: Path | None = None) -> Path:
    target = store.artifact_path(name, key)
    if target.is_file():
        return target
    from ninfer.conversion import OutputExistsError, convert  # torch and the writer: only when converting

    if not quiet:
        print(f"[ninfer] converting {what} (once) into {target}", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        convert(source, target, name=name, registry=registry, progress=progress, draft=draft)
    except OutputExistsError:
        pass  # another process published the same conversion first: it is identical by construction
    return target
