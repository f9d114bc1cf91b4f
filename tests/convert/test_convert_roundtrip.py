"""convert() end to end: synthetic checkpoint -> .ninfer -> ArtifactReader gives the sources back."""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest
import torch
from convert_synth_arch import ARCH
from convert_synth_ckpt import (
    SPECIAL_BF16_BITS,
    raw_bytes,
    synth_tensors,
    tiny_tokenizer_json,
    write_checkpoint,
)
from ninfer.artifact import ArtifactReader
from ninfer.artifact.format import FORMATS
from ninfer.conversion import convert
from ninfer.conversion.errors import ConversionError, OutputExistsError, PlanError

LAYERS = 2
# artifact object -> source tensor, for the objects planned from a single tensor
SINGLES = {
    "text/embed": "model.embed_tokens.weight",
    "text/lm_head": "lm_head.weight",
    "text/final_norm": "model.norm.weight",
    "vision/patch_embed.weight": "visual.patch_embed.weight",
    "vision/position_ids": "visual.position_ids",
    "mtp/fc.weight": "mtp.fc.weight",
    **{f"text/layers/{i}/mlp/down": f"model.layers.{i}.mlp.down_proj.weight" for i in range(LAYERS)},
    **{f"text/layers/{i}/input_norm": f"model.layers.{i}.input_layernorm.weight" for i in range(LAYERS)},
}
# logical parameter -> source tensor, for the fused parents' row-range bindings
FUSED_MEMBERS = {
    **{f"text/layers/{i}/attention/{p}": f"model.layers.{i}.self_attn.{s}_proj.weight"
       for i in range(LAYERS) for p, s in (("query", "q"), ("key", "k"), ("value", "v"))},
    **{f"text/layers/{i}/mlp/{p}": f"model.layers.{i}.mlp.{p}_proj.weight"
       for i in range(LAYERS) for p in ("gate", "up")},
}
_FORMAT_OF = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "int32"}


def _tensor(reader: ArtifactReader, object_id: str) -> torch.Tensor:
    rec = reader.object(object_id)
    data = bytearray(reader.read_object(object_id))
    return torch.frombuffer(data, dtype=FORMATS[rec.format].dtype).reshape(rec.shape)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)


@pytest.fixture
def full_ckpt(tmp_path):
    tensors = synth_tensors(layers=LAYERS, vision=True, mtp=True)
    return tensors, write_checkpoint(tmp_path / "synth-ckpt", tensors, shards=3)


def test_value_preserving_import_keeps_every_byte(tmp_path, registry, full_ckpt):
    tensors, src = full_ckpt
    result = convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)
    assert result.paths == (tmp_path / "m.ninfer",)
    assert result.casts == ()
    with ArtifactReader.open(result.paths[0]) as r:
        for obj_id, name in SINGLES.items():
            rec = r.object(obj_id)
            assert rec.format == _FORMAT_OF[tensors[name].dtype], obj_id
            assert list(rec.shape) == list(tensors[name].shape), obj_id
            assert r.read_object(obj_id) == raw_bytes(tensors[name]), obj_id
        # The special bf16 words (NaN payloads, signed zeros, infinities, subnormal) survived.
        words = _tensor(r, "text/embed").view(torch.int16).view(-1)[:len(SPECIAL_BF16_BITS)]
        assert [w & 0xFFFF for w in words.tolist()] == list(SPECIAL_BF16_BITS)


def test_fused_parent_and_row_range_bindings_round_trip(tmp_path, registry, full_ckpt):
    tensors, src = full_ckpt
    result = convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)
    with ArtifactReader.open(result.paths[0]) as r:
        d = r.directory
        for i in range(LAYERS):
            qkv = f"text/layers/{i}/attention/qkv"
            members = [tensors[f"model.layers.{i}.self_attn.{s}_proj.weight"] for s in "qkv"]
            assert list(r.object(qkv).shape) == [sum(m.shape[0] for m in members), members[0].shape[1]]
            assert r.read_object(qkv) == b"".join(raw_bytes(m) for m in members)
        parents = {}
        for param, name in FUSED_MEMBERS.items():
            binding = d.bindings[param]
            assert binding.object is None and binding.parts, param
            pieces = []
            for part in binding.parts:
                if part.object not in parents:
                    parents[part.object] = _tensor(r, part.object).reshape(-1)
                pieces.append(parents[part.object][part.begin:part.end])
            got = torch.cat(pieces).reshape(tensors[name].shape)
            assert _bits_equal(got, tensors[name]), param
        for obj_id in SINGLES:
            assert d.bindings[obj_id].object == obj_id
        assert {(u.parameter, u.input, u.activation_policy) for u in d.uses} == {
            (name, name + "#input", "A16Only") for name in d.bindings}
        assert set(d.components) == {"text", "vision", "mtp"}
        assert d.components["vision"].target == "text" and d.components["mtp"].target == "text"
        assert d.components["text"].config["architectures"] == [ARCH]


def test_sharded_and_single_file_sources_give_the_same_objects(tmp_path, registry):
    tensors = synth_tensors(layers=LAYERS)
    one = convert(write_checkpoint(tmp_path / "a", tensors), tmp_path / "a.ninfer", registry=registry,
                  progress=False)
    many = convert(write_checkpoint(tmp_path / "b", tensors, shards=4), tmp_path / "b.ninfer",
                   registry=registry, progress=False)
    with ArtifactReader.open(one.paths[0]) as ra, ArtifactReader.open(many.paths[0]) as rb:
        assert [(o.id, o.checksum) for o in ra.directory.objects] == [
            (o.id, o.checksum) for o in rb.directory.objects]


def test_provenance_metadata_and_ignored_tensors(tmp_path, registry, full_ckpt):
    tensors, src = full_ckpt
    result = convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)
    assert result.ignored == ("model.rotary_emb.inv_freq",)
    with ArtifactReader.open(result.paths[0]) as r:
        d = r.directory
        assert d.metadata == {"name": "synth-ckpt"}  # the source folder's name, never the architecture class
        prov = d.provenance
        assert prov["source"]["folder"] == "synth-ckpt"
        assert prov["source"]["architecture"] == ARCH
        files = {f["name"]: f["bytes"] for f in prov["source"]["files"]}
        expected = {p.name: p.stat().st_size for p in src.iterdir()}
        assert files == expected  # config, index, the three shards
        assert prov["converter"] == {"name": "ninfer-core", "version": md.version("ninfer-core")}
        assert prov["source_mapping"] == "synth-mapping"
        assert prov["ignored"] == {"model.rotary_emb.inv_freq": "recomputed from rope_theta"}
        assert prov["casts"] == []
        assert not any("inv_freq" in o.id for o in d.objects)


def test_name_sets_metadata(tmp_path, registry):
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    result = convert(src, tmp_path / "m.ninfer", name="my-model", registry=registry, progress=False)
    with ArtifactReader.open(result.paths[0]) as r:
        assert r.directory.metadata["name"] == "my-model"
    with pytest.raises(ConversionError, match="--name"):
        convert(src, tmp_path / "n.ninfer", name=" ", registry=registry, progress=False)


def test_unknown_source_tensor_fails_naming_it_and_publishes_nothing(tmp_path, registry):
    tensors = synth_tensors(layers=1)
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3, 3)
    src = write_checkpoint(tmp_path / "ck", tensors)
    (tmp_path / "out").mkdir()
    with pytest.raises(PlanError, match=r"'model\.layers\.0\.mystery\.weight'.*neither converted nor ignored"):
        convert(src, tmp_path / "out" / "m.ninfer", registry=registry, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_cast_is_applied_and_recorded(tmp_path, registry):
    tensors = synth_tensors(layers=LAYERS)
    src = write_checkpoint(tmp_path / "ck", tensors, config={"synth_norm_format": "bf16"})
    result = convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)
    # Layer norms are already bf16 (no cast); the fp32 final norm is rounded to bf16.
    assert result.casts == ("text/final_norm",)
    with ArtifactReader.open(result.paths[0]) as r:
        assert _bits_equal(_tensor(r, "text/final_norm"), tensors["model.norm.weight"].to(torch.bfloat16))
        assert r.read_object("text/layers/0/input_norm") == raw_bytes(tensors["model.layers.0.input_layernorm.weight"])
        assert r.directory.provenance["casts"] == [{"object": "text/final_norm", "from": "F32", "to": "bf16",
                                                    "rounding": "round-to-nearest-even (torch.Tensor.to)"}]

    src32 = write_checkpoint(tmp_path / "ck32", tensors, config={"synth_norm_format": "fp32"})
    result = convert(src32, tmp_path / "m32.ninfer", registry=registry, progress=False)
    assert set(result.casts) == {f"text/layers/{i}/input_norm" for i in range(LAYERS)}
    with ArtifactReader.open(result.paths[0]) as r:
        got = _tensor(r, "text/layers/1/input_norm")
        assert _bits_equal(got, tensors["model.layers.1.input_layernorm.weight"].float())


def test_cast_overflow_fails_naming_the_object_and_publishes_nothing(tmp_path, registry):
    tensors = synth_tensors(layers=1)
    tensors["model.norm.weight"][3] = 1e6  # finite in fp32, beyond fp16's 65504
    src = write_checkpoint(tmp_path / "ck", tensors, config={"synth_norm_format": "fp16"})
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match=r"'text/final_norm'.*overflows fp16"):
        convert(src, tmp_path / "out" / "m.ninfer", registry=registry, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_resources_are_stored_on_their_components(tmp_path, registry):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    files = {
        "tokenizer.json": tiny_tokenizer_json(),
        "tokenizer_config.json": json.dumps({"chat_template": template, "eos_token": "<e>"}),
        "generation_config.json": json.dumps({"eos_token_id": [1, 2]}),
        "preprocessor_config.json": json.dumps({"patch_size": 16}),
        "video_preprocessor_config.json": json.dumps({"fps": 2}),
    }
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1, vision=True), files=files)
    result = convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)
    with ArtifactReader.open(result.paths[0]) as r:
        text = r.component("text").resources
        assert dict(text) == {role: f"resource/text/{role}" for role in (
            "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")}
        for role in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert r.resource("text", role) == files[role].encode()
        # No chat_template.jinja in the folder: the tokenizer_config.json string is stored.
        assert r.resource("text", "chat_template.jinja") == template.encode()
        assert r.directory.provenance["derived_resources"] == {
            "resource/text/chat_template.jinja": "tokenizer_config.json"}
        for role in ("preprocessor_config.json", "video_preprocessor_config.json"):
            assert r.resource("vision", role) == files[role].encode()
        assert r.object("resource/text/tokenizer.json").kind == "resource"

    # A chat_template.jinja file wins; without a vision component no preprocessor is stored.
    files["chat_template.jinja"] = "{{ 'own template' }}"
    src2 = write_checkpoint(tmp_path / "ck2", synth_tensors(layers=1), files=files)
    result = convert(src2, tmp_path / "m2.ninfer", registry=registry, progress=False)
    with ArtifactReader.open(result.paths[0]) as r:
        assert r.resource("text", "chat_template.jinja") == b"{{ 'own template' }}"
        assert "derived_resources" not in r.directory.provenance
        assert set(r.directory.components) == {"text"}
        assert not any("preprocessor" in o.id for o in r.directory.objects)


def test_multi_part_output_with_a_tiny_cap(tmp_path, registry):
    tensors = synth_tensors(layers=3, hidden=64, kv=32, inter=96, vocab=128)
    src = write_checkpoint(tmp_path / "ck", tensors, files={"tokenizer.json": tiny_tokenizer_json()})
    cap = 64 * 1024
    result = convert(src, tmp_path / "m.ninfer", max_file_bytes=cap, registry=registry, progress=False)
    assert len(result.paths) >= 3
    assert [p.name for p in result.paths[1:]] == [f"m.ninfer.part-{i:04d}" for i in range(1, len(result.paths))]
    assert all(p.stat().st_size <= cap for p in result.paths)
    with ArtifactReader.open(result.paths[0]) as r:
        for obj_id, name in SINGLES.items():
            if name in tensors:
                assert r.read_object(obj_id) == raw_bytes(tensors[name]), obj_id
        qkv = b"".join(raw_bytes(tensors[f"model.layers.2.self_attn.{s}_proj.weight"]) for s in "qkv")
        assert r.read_object("text/layers/2/attention/qkv") == qkv
        for obj in r.directory.objects:  # every checksum holds across the file boundaries
            r.verify_object(obj.id)
        assert set(r.opened_files) == set(result.paths)


def test_existing_output_is_refused_and_kept(tmp_path, registry):
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    out = tmp_path / "m.ninfer"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError, match=r"m\.ninfer.*already exists"):
        convert(src, out, registry=registry, progress=False)
    assert out.read_bytes() == b"keep me"


def test_output_folder_missing_or_a_file_is_named(tmp_path, registry):
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    with pytest.raises(ConversionError, match=r"output folder .*nope' does not exist"):
        convert(src, tmp_path / "nope" / "m.ninfer", registry=registry, progress=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConversionError, match=r"output folder .*afile' is not a folder"):
        convert(src, tmp_path / "afile" / "m.ninfer", registry=registry, progress=False)


def test_output_naming_a_folder_is_refused(tmp_path, registry):
    # 'out/' must not become a file named 'out', and an existing folder is not overwritten or written into.
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    with pytest.raises(ConversionError, match=r"output '.*new/' names a folder; .*new/model\.ninfer'"):
        convert(src, f"{tmp_path}/new/", registry=registry, progress=False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    with pytest.raises(ConversionError, match=r"output '.*there' names a folder"):
        convert(src, tmp_path / "there", registry=registry, progress=False)
    assert list((tmp_path / "there").iterdir()) == []


def test_progress_bar_only_when_asked(tmp_path, registry, capsys):
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    convert(src, tmp_path / "quiet.ninfer", registry=registry, progress=False)
    assert capsys.readouterr().err == ""
    convert(src, tmp_path / "loud.ninfer", registry=registry, progress=True)
    err = capsys.readouterr().err
    assert "loud.ninfer" in err and "100%" in err
