"""Fixtures for model resolution: a private ninfer cache, and a Hugging Face hub cache laid out on disk as
huggingface_hub writes it (``models--owner--name/{blobs,refs,snapshots}``, snapshot files symlinked into
``blobs``) holding the embedded default model's checkpoint under a repo id."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ID = "acme/tiny-qwen"
COMMIT = "a" * 40


def default_checkpoint() -> Path:
    from ninfer.plugins import get_registry

    return get_registry().default_models["qwen3_5-stdlib"].source


def checkpoint_files() -> dict[str, bytes]:
    """The default model's checkpoint files (the training report is not part of a Hub checkpoint)."""
    return {p.name: p.read_bytes() for p in sorted(default_checkpoint().iterdir())
            if p.is_file() and p.name != "training_report.json"}


def add_snapshot(hub: Path, repo_id: str, commit: str, files: dict[str, bytes], *, ref: str | None = "main") -> Path:
    """Lay ``files`` out as commit ``commit`` of ``repo_id`` in the hub cache ``hub`` (blobs named by content
    digest, snapshot entries relative symlinks to them); ``ref`` (a branch) then points at the commit."""
    repo_dir = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def ninfer_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "ninfer-cache"
    monkeypatch.setenv("NINFER_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def hf_env(tmp_path, monkeypatch) -> Path:
    """HF_HOME in tmp_path (no other hub variable set, online); returns its hub cache folder, still empty."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return tmp_path / "hf-home" / "hub"


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The sources every ninfer.conversion.convert call of this test converted, in order."""
    import ninfer.conversion

    calls: list[Path] = []
    real = ninfer.conversion.convert

    def counting(source, output, **kw):
        calls.append(Path(source))
        return real(source, output, **kw)

    monkeypatch.setattr(ninfer.conversion, "convert", counting)
    return calls


def recorded_name(artifact: Path) -> str | None:
    from ninfer.artifact import ArtifactReader

    with ArtifactReader.open(artifact) as reader:
        return (reader.directory.metadata or {}).get("name")


@pytest.fixture
def run_ninfer(tmp_path):
    """Run ``ninfer`` in a subprocess with a private, initially empty NINFER_CACHE_DIR (``run.cache``)."""
    cache = tmp_path / "cli-cache"
    env = dict(os.environ, NINFER_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    env.pop("NINFER_PLUGINS", None)

    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ninfer.cli.main", *args], input=stdin, env=env,
                              capture_output=True, text=True, timeout=240)

    run.cache = cache
    return run


def copy_artifact(artifact: Path, cache: Path, file_name: str) -> Path:
    target = cache / "artifacts" / file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(artifact, target)
    return target
