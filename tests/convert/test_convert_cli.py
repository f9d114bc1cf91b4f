"""The ``ninfer-convert`` command: verify (subprocess), error paths and usage."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from convert_synth_ckpt import synth_tensors, tiny_tokenizer_json, write_checkpoint
from ninfer.artifact import ArtifactReader
from ninfer.artifact.format import HEADER_BYTES, PAYLOAD_ALIGN, align_up
from ninfer.conversion import convert
from ninfer_convert.cli import main
from ninfer_convert.verify import verify_artifact


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "ninfer_convert.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_verify_passes_then_names_the_corrupted_object(tmp_path, registry):
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=2), files={"tokenizer.json": tiny_tokenizer_json()})
    entry = convert(src, tmp_path / "m.ninfer", registry=registry, progress=False).paths[0]
    with ArtifactReader.open(entry) as r:
        n_objects = len(r.directory.objects)
        total = sum(o.bytes for o in r.directory.objects)
        victim = r.object("text/layers/1/mlp/down")

    ok = _cli("verify", str(entry))
    assert ok.returncode == 0, ok.stderr
    assert f"{n_objects} objects" in ok.stdout and f"{total} bytes" in ok.stdout and ok.stdout.rstrip().endswith("OK")
    assert ok.stderr == ""  # not a terminal: no progress bar

    data = bytearray(entry.read_bytes())
    json_bytes = int.from_bytes(data[8:16], "little")
    pos = align_up(HEADER_BYTES + json_bytes, PAYLOAD_ALIGN) + victim.offset + victim.bytes // 2
    data[pos] ^= 0x01
    entry.write_bytes(bytes(data))
    bad = _cli("verify", str(entry))
    assert bad.returncode == 1
    assert "object 'text/layers/1/mlp/down' failed verification" in bad.stderr
    assert "OK" not in bad.stdout


def test_unknown_architecture_with_the_installed_plugins(tmp_path):
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), architecture="NoSuchArchForTestLM")
    out = tmp_path / "m.ninfer"
    res = _cli(str(src), str(out), "--quiet")
    assert res.returncode == 1
    assert "no installed plugin converts checkpoints of architecture 'NoSuchArchForTestLM'" in res.stderr
    assert not out.exists()


def test_error_paths_exit_1_with_the_reason(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    out = tmp_path / "m.ninfer"
    out.write_bytes(b"keep")
    assert main([str(src), str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert out.read_bytes() == b"keep"

    (src / "config.json").unlink()
    assert main([str(src), str(tmp_path / "n.ninfer"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer-convert: error: ") and "has no config.json" in err

    assert main(["verify", str(tmp_path / "missing.ninfer")]) == 1
    assert "missing.ninfer" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["only-src"], ["a", "b", "--max-file-bytes", "0"], ["verify"]])
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_cli_converts_a_real_qwen3_5_checkpoint_with_the_installed_plugin(tmp_path):
    """Smoke test of the product path: entry-point plugins, the console command, then verify."""
    sys.modules.setdefault("fla", None)  # transformers' torch GDN path on CPU
    sys.modules.setdefault("causal_conv1d", None)
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors import safe_open

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, intermediate_size=48, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    src = tmp_path / "tiny-qwen"
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(src, safe_serialization=True)
    (src / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')

    out = tmp_path / "tiny.ninfer"
    res = _cli(str(src), str(out), "--name", "tiny-qwen", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "source mapping qwen3_5" in res.stdout
    # Weights only (no tokenizer.json): converted, with a warning that no engine can start on it.
    assert res.stderr.startswith("ninfer-convert: warning: ") and "has no tokenizer.json" in res.stderr, res.stderr
    assert verify_artifact(out, progress=False).objects > 0  # the verify command itself is tested above

    with ArtifactReader.open(out) as r:
        assert r.directory.metadata == {"name": "tiny-qwen"}
        assert r.directory.provenance["source_mapping"] == "qwen3_5"
        assert r.resource("text", "chat_template.jinja") == b"{{ messages }}"
        binding = r.directory.bindings["text/embed"]
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            name = next(n for n in f.keys() if n.endswith("embed_tokens.weight"))
            embed = f.get_tensor(name)
        assert binding.object is not None
        assert r.read_object(binding.object) == embed.contiguous().view(torch.uint8).numpy().tobytes()

    # A tokenizer with more ids than the model's vocabulary converts to an artifact no engine could start:
    # refused at conversion with the frontend's reason, and nothing is written.
    from ninfer.testing.checkpoints import write_byte_tokenizer

    write_byte_tokenizer(src)   # 256 bytes + the ChatML specials > vocab_size 128
    bad = tmp_path / "bad.ninfer"
    res = _cli(str(src), str(bad), "--quiet")
    assert res.returncode == 1 and not bad.exists()
    assert ("would not load: the 'qwen' frontend refuses its text resources: vocab_size 128 is smaller than the "
            "tokenizer's") in res.stderr, res.stderr


@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_the_write_publishes_nothing_and_leaves_no_temp(tmp_path, monkeypatch, capsys, sig, status):
    """SIGTERM (a service manager stopping the conversion) is handled as Ctrl-C is: the temporary files go, nothing
    is published, and the exit status says which it was."""
    import signal

    import ninfer.artifact.writer as writer_mod
    import torch

    sys.modules.setdefault("fla", None)
    sys.modules.setdefault("causal_conv1d", None)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, layer_types=[
            "linear_attention", "full_attention"])
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    src = tmp_path / "tiny-qwen"
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(src, safe_serialization=True)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = writer_mod.ArtifactWriter.write
    calls = []

    def write_then_signal(self, object_id, data):
        real(self, object_id, data)
        calls.append(object_id)
        if len(calls) == 2:
            os.kill(os.getpid(), getattr(signal, sig))

    monkeypatch.setattr(writer_mod.ArtifactWriter, "write", write_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    assert main([str(src), str(out_dir / "m.ninfer"), "--quiet"]) == status
    assert list(out_dir.iterdir()) == [] and len(calls) == 2
    assert ("terminated" if sig == "SIGTERM" else "interrupted") in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before   # main puts the handler back
