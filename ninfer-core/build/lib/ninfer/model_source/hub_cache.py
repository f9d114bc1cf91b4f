"""Hugging Face repo ids: finding a snapshot in the local hub cache, or downloading one into it.

The hub cache is the folder ``huggingface_hub`` shares with transformers and vLLM: ``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``. A repo lives in
``models--{owner}--{name}``: ``refs/{branch}`` holds a commit sha, ``snapshots/{sha}/`` the files (usually
symlinks into ``blobs/``). Invariants:

- a cached snapshot is used only when it is complete for conversion (:func:`missing_files` is empty); the
  hub cache is read with no network access;
- a download fetches only what conversion reads (config, generation config, tokenizer files, chat template,
  and the weights of the index, else the top-level ``*.safetensors``), into the same hub cache;
- ``HF_HUB_OFFLINE`` set to a true value forbids downloading; every download failure (no network, unknown
  or gated repo, unknown revision) is a :class:`ModelSourceError` naming the repo id and the cause.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ninfer.model_source.errors import ModelSourceError

INDEX_NAME = "model.safetensors.index.json"
# Everything but the weights that conversion may read (ninfer.conversion.resources); absent ones are skipped.
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
               "video_preprocessor_config.json", INDEX_NAME)
# The Hub's own rule for owner and repo names; "--" and ".." are refused by the Hub too.
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_RE = re.compile(rf"(?P<owner>{_PART})/(?P<name>{_PART})(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]*))?")
_TRUE = ("1", "on", "yes", "true")


@dataclass(frozen=True)
class HubRepo:
    """A repo id as a user wrote it: ``owner/name``, optionally ``@revision`` (a branch, tag or commit sha;
    None means the ``main`` branch)."""

    repo_id: str
    revision: str | None = None

    @property
    def cache_folder_name(self) -> str:
        return "models--" + self.repo_id.replace("/", "--")

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class Snapshot:
    """One commit of a repo on disk: ``folder`` is ``.../snapshots/{commit}``."""

    repo_id: str
    commit: str
    folder: Path


def parse_repo_id(text: str) -> HubRepo | None:
    """The HubRepo ``text`` spells, or None when it is not shaped like ``owner/name[@revision]``."""
    m = _REPO_RE.fullmatch(text)
    if m is None or any("--" in p or ".." in p for p in (m["owner"], m["name"])) or text.endswith(".ninfer"):
        return None
    return HubRepo(f"{m['owner']}/{m['name']}", m["revision"])


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps repos (the module docstring gives the order)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "huggingface" / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def snapshot_of_folder(folder: Path) -> Snapshot | None:
    """The Snapshot a folder is when it sits in a hub cache (``models--o--n/snapshots/{sha}``), else None."""
    folder = folder.absolute()
    repo_dir = folder.parent.parent
    if folder.parent.name != "snapshots" or not repo_dir.name.startswith("models--"):
        return None
    owner, sep, name = repo_dir.name[len("models--"):].partition("--")
    repo = parse_repo_id(f"{owner}/{name}") if sep else None
    return Snapshot(repo.repo_id, folder.name, folder) if repo is not None else None


def cached_snapshot(repo: HubRepo, cache: Path) -> Snapshot | None:
    """The snapshot of ``repo`` in ``cache`` (its ref's commit, or the commit the revision names), or None."""
    repo_dir = cache / repo.cache_folder_name
    revision = repo.revision or "main"
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    elif (repo_dir / "snapshots" / revision).is_dir():
        commit = revision
    else:
        return None
    folder = repo_dir / "snapshots" / commit
    return Snapshot(repo.repo_id, commit, folder) if commit and folder.is_dir() else None


def missing_files(folder: Path) -> list[str]:
    """The files conversion needs that ``folder`` lacks: config.json and the weights (every shard of the
    index, else at least one top-level ``*.safetensors``). A dangling blob symlink counts as missing."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return missing  # a broken index: conversion names the problem
        missing += [s for s in shards if not (folder / s).is_file()]
    elif not any(p.is_file() for p in folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def download(repo: HubRepo, cache: Path, *, quiet: bool) -> Snapshot:
    """Download what conversion needs of ``repo`` into ``cache`` with huggingface_hub: the small files and the
    index first, then the weights the index lists (else the top-level ``*.safetensors``)."""
    if offline():
        raise ModelSourceError(f"{repo} is not in the Hugging Face cache at {cache} and HF_HUB_OFFLINE is set, "
                               f"so it cannot be downloaded: unset HF_HUB_OFFLINE, or download it elsewhere "
                               f"('hf download {repo.repo_id}') and copy the cache folder "
                               f"{repo.cache_folder_name} there")
    try:
        import huggingface_hub
    except ImportError as exc:
        raise ModelSourceError(f"{repo} is not in the Hugging Face cache at {cache}, and downloading it needs "
                               f"the huggingface_hub package ({exc})") from None
    if not quiet:
        print(f"[ninfer] downloading {repo} from the Hugging Face Hub into {cache}", file=sys.stderr, flush=True)

    def fetch(patterns: list[str]) -> Path:
        try:
            # "*/*" keeps subfolders out: conversion reads only the top level.
            return Path(huggingface_hub.snapshot_download(
                repo.repo_id, revision=repo.revision, cache_dir=cache, allow_patterns=patterns,
                ignore_patterns=["*/*"], library_name="ninfer"))
        except Exception as exc:  # network, HTTP, auth, disk: all become one error naming the repo
            raise ModelSourceError(f"cannot download {repo} from the Hugging Face Hub into {cache}: "
                                   f"{_cause(exc)}") from None

    folder = fetch(list(SMALL_FILES))
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weights = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelSourceError(f"{repo}: {INDEX_NAME} has no readable weight_map ({exc})") from None
    else:
        weights = ["*.safetensors"]
    folder = fetch(weights)
    lacking = missing_files(folder)
    if lacking:
        raise ModelSourceError(f"{repo} on the Hugging Face Hub lacks {', '.join(lacking)}: NInfer converts "
                               f"safetensors checkpoints with a config.json")
    return Snapshot(repo.repo_id, folder.name, folder)


def _cause(exc: Exception) -> str:
    """One line saying why a download failed, with what to do for the common causes."""
    kind = type(exc).__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
    if kind == "GatedRepoError":
        return (f"the repo is gated: accept its terms on its Hub page and log in ('hf auth login' or HF_TOKEN) "
                f"({first})")
    if kind == "RepositoryNotFoundError":
        return f"no such repo, or it is private and you are not logged in ('hf auth login' or HF_TOKEN) ({first})"
    if kind == "RevisionNotFoundError":
        return f"no such revision ({first})"
    if kind in ("LocalEntryNotFoundError", "ConnectionError", "ConnectError", "Timeout", "TimeoutException"):
        return f"the Hub cannot be reached ({first})"
    return f"{kind}: {first}"
