"""``ninfer info``: the text and JSON descriptions, via the real command and in process."""

from __future__ import annotations

import json
import subprocess
import sys

import ninfer.plugins
from artifact_testlib import flip_payload_byte
from ninfer.artifact import ArtifactReader, describe, summarize
from ninfer.cli.main import main
from ninfer.contracts.architecture import ArchitectureSpec


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer.cli.main", "info", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_info_text_and_json_via_the_command(tiny_parts):
    with ArtifactReader.open(tiny_parts.path) as r:
        artifact_id, n_files = r.artifact_id, len(r.files)
    text = _run(tiny_parts.path)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert f"artifact id: {artifact_id}" in out
    assert "name:        tiny-test" in out
    assert f"files ({n_files}):" in out and "tiny.ninfer.part-0001" in out
    assert "text: TinyForCausalLM" in out and "mtp: TinyMTP  (targets text)" in out
    assert "hidden_size=8" in out and 'layer_types={"full_attention": 1}' in out
    assert "tokenizer.json (27 B)" in out
    assert "mtp: 2 objects, 1 shared" in out        # mtp.fc and the shared embedding
    assert "bf16: 3 objects" in out and "fp32: 2 objects" in out and "resource:raw_bytes_v1: 1 objects" in out
    assert "bindings: 9; uses: 2" in out
    assert 'provenance: {"source": "synthetic"}' in out

    js = _run(tiny_parts.path, "--json")
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)
    assert data["artifact_id"] == artifact_id and len(data["files"]) == n_files
    assert [c["id"] for c in data["components"]] == ["text", "mtp"]
    text_bytes = data["objects_by_component"]["text"]["bytes"]
    assert text_bytes == 8192 + 128 + 32 + 4 + 27
    assert data["objects"]["count"] == 6 and data["objects"]["resources"] == 1


def test_info_reads_no_payload_and_reports_missing_parts(tiny_parts, capsys):
    with ArtifactReader.open(tiny_parts.path) as r:
        last = r.files[-1]
    last.unlink()
    assert main(["info", str(tiny_parts.path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if last.name in ln)
    assert line.endswith("(MISSING)")
    with ArtifactReader.open(tiny_parts.path) as r:
        s = summarize(r)
        assert r.opened_files == (tiny_parts.path,)
    assert [f["present"] for f in s["files"]] == [True] * (len(s["files"]) - 1) + [False]


def test_info_verify_fails_on_a_corrupt_object(tiny, capsys):
    assert main(["info", "--verify", str(tiny.path)]) == 0
    assert "verified: all 6 object checksums match" in capsys.readouterr().out
    with ArtifactReader.open(tiny.path) as r:
        flip_payload_byte(r, r.object("mtp.fc").offset)
    assert main(["info", "--verify", str(tiny.path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer info: error:") and "'mtp.fc'" in err


def test_info_on_a_bad_file_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"not an artifact at all, but long enough for a header")
    assert main(["info", str(bad)]) == 2
    assert "bad.ninfer" in capsys.readouterr().err


def test_config_summary_comes_from_the_plugin_when_installed(tiny, monkeypatch):
    spec = ArchitectureSpec(
        name="TinyForCausalLM", family="tiny", parameter_specs=lambda c, f: [], profile=lambda c, f: None,
        create_program=lambda init: None, frontend="tiny",
        summarize_config=lambda c: {"layers": c["num_hidden_layers"], "width": c["hidden_size"]})

    class FakeRegistry:
        architectures = {"TinyForCausalLM": spec}

    monkeypatch.setattr(ninfer.plugins, "get_registry", lambda: FakeRegistry())
    with ArtifactReader.open(tiny.path) as r:
        out = describe(r)
    assert "config [plugin architecture TinyForCausalLM]: layers=1, width=8" in out
    assert "config [raw config]: (no key fields)" in out   # TinyMTP has no plugin: raw fields


def test_info_without_a_model_describes_the_default_model(default_model_cache, default_artifact, tmp_path,
                                                          monkeypatch, capsys):
    """Like ``ninfer generate``, ``ninfer info`` with no model resolves the default model (here from a cache
    that already holds it); a bad command line fails before anything is resolved or converted."""
    monkeypatch.setenv("NINFER_CACHE_DIR", str(default_model_cache))
    with ArtifactReader.open(default_artifact) as r:
        artifact_id = r.artifact_id
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"artifact:    {default_artifact}\n") and f"artifact id: {artifact_id}" in out
    assert main(["info", "--json", "--memory", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["path"] == str(default_artifact) and data["memory"]["device"] == "cpu"

    empty = tmp_path / "empty-cache"
    monkeypatch.setenv("NINFER_CACHE_DIR", str(empty))
    assert main(["info", "--num-pages", "3"]) == 2
    assert "memory plan options, which need --memory" in capsys.readouterr().err
    assert not empty.exists()
