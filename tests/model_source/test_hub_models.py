"""Models named by Hugging Face repo id or shipped default-model name, resolved from a real hub cache layout."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import pytest
from ninfer.model_source import ModelSourceError, resolve_model
from ninfer.model_source.hub_cache import SMALL_FILES, HubRepo, download, parse_repo_id

from .conftest import COMMIT, REPO_ID, add_snapshot, checkpoint_files, recorded_name


def test_repo_id_resolves_from_hf_home_and_converts_once(hf_env, ninfer_cache, conversions):
    snapshot = add_snapshot(hf_env, REPO_ID, COMMIT, checkpoint_files())
    first = resolve_model(REPO_ID, quiet=True)
    assert first.parent == ninfer_cache / "artifacts"
    assert first.name.startswith("acme--tiny-qwen-") and first.suffix == ".ninfer"
    assert recorded_name(first) == REPO_ID
    assert conversions == [snapshot]
    assert resolve_model(REPO_ID, quiet=True) == first
    assert conversions == [snapshot]  # the second resolve found the artifact by repo id and commit


def test_hf_hub_cache_variable_wins_over_hf_home(tmp_path, hf_env, ninfer_cache, monkeypatch):
    hub = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    add_snapshot(hub, REPO_ID, COMMIT, checkpoint_files())
    assert recorded_name(resolve_model(REPO_ID, quiet=True)) == REPO_ID
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="other/model"):
        resolve_model("other/model", quiet=True)


def test_new_commit_converts_again_and_revision_picks_a_commit(hf_env, ninfer_cache, conversions):
    files = checkpoint_files()
    add_snapshot(hf_env, REPO_ID, COMMIT, files)
    old = resolve_model(REPO_ID, quiet=True)
    newer = "b" * 40
    add_snapshot(hf_env, REPO_ID, newer, files)  # refs/main now names the newer commit
    new = resolve_model(REPO_ID, quiet=True)
    assert new != old and recorded_name(new) == REPO_ID
    assert resolve_model(f"{REPO_ID}@{COMMIT}", quiet=True) == old
    assert len(conversions) == 2


def test_engine_serves_the_repo_id(hf_env, ninfer_cache):
    from ninfer import Engine

    add_snapshot(hf_env, REPO_ID, COMMIT, checkpoint_files())
    with Engine.start(resolve_model(REPO_ID, quiet=True), device="cpu", dtype="float32", max_concurrency=1,
                      max_context=64) as engine:
        assert engine.info["name"] == REPO_ID


def test_snapshot_folder_given_as_a_path_is_named_by_its_repo(hf_env, ninfer_cache):
    snapshot = add_snapshot(hf_env, REPO_ID, COMMIT, checkpoint_files())
    artifact = resolve_model(snapshot, quiet=True)
    assert recorded_name(artifact) == REPO_ID
    assert resolve_model(REPO_ID, quiet=True) == artifact


def test_folder_name_is_the_served_name_and_the_file_name_is_safe(tmp_path, ninfer_cache):
    folder = tmp_path / "my model"
    folder.mkdir()
    for name, data in checkpoint_files().items():
        (folder / name).write_bytes(data)
    artifact = resolve_model(folder, quiet=True)
    assert recorded_name(artifact) == "my model"
    assert artifact.name.startswith("my_model-")


def test_default_model_by_name(ninfer_cache, conversions):
    by_name = resolve_model("qwen3_5-stdlib", quiet=True)
    assert resolve_model(None, quiet=True) == by_name
    assert recorded_name(by_name) == "qwen3_5-stdlib"
    assert len(conversions) == 1


def test_converted_artifact_serves_after_the_hub_download_is_deleted(hf_env, ninfer_cache, monkeypatch):
    add_snapshot(hf_env, REPO_ID, COMMIT, checkpoint_files())
    artifact = resolve_model(REPO_ID, quiet=True)
    shutil.rmtree(hf_env)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO_ID, quiet=True) == artifact


def test_offline_and_not_cached_names_repo_and_cache(hf_env, ninfer_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError) as err:
        resolve_model("acme/missing", quiet=True)
    message = str(err.value)
    assert "acme/missing" in message and str(hf_env) in message and "HF_HUB_OFFLINE" in message


def test_offline_incomplete_snapshot_names_the_missing_file(hf_env, ninfer_cache, monkeypatch):
    files = {k: v for k, v in checkpoint_files().items() if not k.endswith(".safetensors")}
    add_snapshot(hf_env, REPO_ID, COMMIT, files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match=r"acme/tiny-qwen: the snapshot .* lacks \*\.safetensors"):
        resolve_model(REPO_ID, quiet=True)


def test_unknown_name_lists_the_forms(ninfer_cache):
    with pytest.raises(ModelSourceError, match=r"'no-such-model' not found.*qwen3_5-stdlib.*owner/name"):
        resolve_model("no-such-model", quiet=True)


@pytest.mark.parametrize("text, expected", [
    ("Qwen/Qwen3.5-9B", HubRepo("Qwen/Qwen3.5-9B")),
    ("Qwen/Qwen3.5-9B@main", HubRepo("Qwen/Qwen3.5-9B", "main")),
    ("org/m@refs/pr/1", HubRepo("org/m", "refs/pr/1")),
    ("./model", None), ("a/b/c", None), ("model.ninfer", None), ("dir/x.ninfer", None), ("a--b/c", None),
    ("a/..b", None), ("/abs/path", None), ("plain", None), ("a/b@", None),
])
def test_parse_repo_id(text, expected):
    assert parse_repo_id(text) == expected


class FakeHub:
    """Stands in for huggingface_hub.snapshot_download: serves ``files`` of one repo into the hub cache
    layout, honouring allow_patterns and ignore_patterns the way the Hub does (fnmatch over the path)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.calls: list[dict] = []

    def __call__(self, repo_id, *, revision=None, cache_dir=None, allow_patterns=None, ignore_patterns=None, **kw):
        self.calls.append(dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir,
                               allow_patterns=list(allow_patterns), ignore_patterns=list(ignore_patterns or ())))
        chosen = {p: d for p, d in self.files.items()
                  if any(fnmatch.fnmatch(p, a) for a in allow_patterns)
                  and not any(fnmatch.fnmatch(p, i) for i in ignore_patterns or ())}
        snapshot = Path(cache_dir) / ("models--" + repo_id.replace("/", "--")) / "snapshots" / COMMIT
        have = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")} if snapshot.is_dir() else set()
        add_snapshot(Path(cache_dir), repo_id, COMMIT, {p: d for p, d in chosen.items() if p not in have})
        return str(snapshot)


def test_download_fetches_only_what_conversion_reads(hf_env, ninfer_cache, monkeypatch, conversions):
    import huggingface_hub

    files = dict(checkpoint_files(), **{"README.md": b"# card", "pytorch_model.bin": b"pickle",
                                        "original/consolidated.safetensors": b"other weights"})
    hub = FakeHub(files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    artifact = resolve_model(REPO_ID, quiet=True)
    assert recorded_name(artifact) == REPO_ID
    assert [c["repo_id"] for c in hub.calls] == [REPO_ID, REPO_ID]
    assert all(c["cache_dir"] == hf_env and c["ignore_patterns"] == ["*/*"] for c in hub.calls)
    assert hub.calls[0]["allow_patterns"] == list(SMALL_FILES)
    assert hub.calls[1]["allow_patterns"] == ["*.safetensors"]  # no index: every top-level safetensors file
    snapshot = hf_env / "models--acme--tiny-qwen" / "snapshots" / COMMIT
    got = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert got == sorted(checkpoint_files())
    assert conversions == [snapshot]
    resolve_model(REPO_ID, quiet=True)
    assert len(hub.calls) == 2  # now cached: no further download


def test_download_of_a_sharded_repo_fetches_the_index_shards(hf_env, monkeypatch):
    import huggingface_hub

    index = b'{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}'
    files = {"config.json": b"{}", "model.safetensors.index.json": index, "model-1.safetensors": b"1",
             "model-2.safetensors": b"2", "consolidated.safetensors": b"duplicate"}
    hub = FakeHub(files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    snapshot = download(HubRepo("acme/sharded", "v1"), hf_env, quiet=True)
    assert hub.calls[1]["allow_patterns"] == ["model-1.safetensors", "model-2.safetensors"]
    assert {c["revision"] for c in hub.calls} == {"v1"}
    assert sorted(p.name for p in snapshot.folder.iterdir()) == [
        "config.json", "model-1.safetensors", "model-2.safetensors", "model.safetensors.index.json"]
    assert (snapshot.repo_id, snapshot.commit) == ("acme/sharded", COMMIT)


def _gated() -> Exception:
    import httpx
    from huggingface_hub.errors import GatedRepoError

    response = httpx.Response(403, request=httpx.Request("GET", "https://huggingface.co/api/models/acme/gated"))
    return GatedRepoError("403 Client Error: access to this model is restricted", response=response)


@pytest.mark.parametrize("raised, cause", [
    (lambda: ConnectionError("Name or service not known"), "cannot be reached"),
    (_gated, "gated"),
    (lambda: OSError("No space left on device"), "No space left on device"),
])
def test_download_failure_names_the_repo_and_the_cause(hf_env, ninfer_cache, monkeypatch, raised, cause):
    import huggingface_hub

    def failing(*args, **kwargs):
        raise raised()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ModelSourceError) as err:
        resolve_model("acme/gated", quiet=True)
    assert "acme/gated" in str(err.value) and cause in str(err.value) and str(hf_env) in str(err.value)
