"""The converter refuses broken text resources up front, naming the file (and publishes nothing)."""

from __future__ import annotations

import json

import pytest
from convert_synth_ckpt import synth_tensors, tiny_tokenizer_json, write_checkpoint
from ninfer.artifact import ArtifactReader
from ninfer.conversion import convert
from ninfer.conversion.errors import SourceError
from ninfer_convert.cli import main

# A chat template written the way HF templates are: loop controls, tojson, raise_exception.
GOOD_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'x' %}{{ raise_exception('no') }}{% endif %}"
                 "{{ m['content'] | tojson }}{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}")


def _good_files() -> dict[str, str]:
    return {
        "tokenizer.json": tiny_tokenizer_json(),
        "tokenizer_config.json": json.dumps({"eos_token": {"content": "<e>", "special": True}}),
        "generation_config.json": json.dumps({"eos_token_id": 3, "temperature": 0.7, "top_k": None}),
        "chat_template.jinja": GOOD_TEMPLATE,
    }


def _convert_fails(tmp_path, registry, files: dict[str, str | bytes], match: str) -> SourceError:
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), files=files)
    (tmp_path / "out").mkdir()
    with pytest.raises(SourceError, match=match) as info:
        convert(src, tmp_path / "out" / "m.ninfer", registry=registry, progress=False)
    assert list((tmp_path / "out").iterdir()) == []  # refused before anything was written
    assert "\n" not in str(info.value)
    return info.value


def test_good_resources_convert_and_are_stored_as_is(tmp_path, registry):
    files = _good_files()
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), files=files)
    result = convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)
    with ArtifactReader.open(result.paths[0]) as r:
        for role, content in files.items():
            assert r.resource("text", role) == content.encode()


@pytest.mark.parametrize(("content", "problem"), [
    ("{}", r"Model missing"),
    (json.dumps({"model": {"type": "BPE"}}), r"Missing vocab/merges"),
    ("not json", r"expected"),
])
def test_a_tokenizer_json_the_library_cannot_load(tmp_path, registry, content, problem):
    files = {**_good_files(), "tokenizer.json": content}
    _convert_fails(tmp_path, registry, files,
                   rf"tokenizer\.json' is not a tokenizer the tokenizers library can load: .*{problem}")


def test_a_tokenizer_json_that_is_not_utf8(tmp_path, registry):
    files = {**_good_files(), "tokenizer.json": b'{"model": "\xff"}'}
    _convert_fails(tmp_path, registry, files, r"tokenizer\.json' is not UTF-8 text")


@pytest.mark.parametrize("role", ["tokenizer_config.json", "generation_config.json"])
@pytest.mark.parametrize(("content", "problem"), [
    ('{"eos_token": ', r"is not valid JSON: Expecting value"),
    (b'{"a": "\xff"}', r"is not valid JSON: .*utf-8"),
    ("[1, 2]", r"must hold a JSON object, not an array"),
    ('"text"', r"must hold a JSON object, not a string"),
    ("null", r"must hold a JSON object, not null"),
])
def test_a_json_config_that_is_not_a_json_object(tmp_path, registry, role, content, problem):
    files = {**_good_files(), role: content}
    _convert_fails(tmp_path, registry, files, rf"resource file '[^']*{role.replace('.', '[.]')}' {problem}")


@pytest.mark.parametrize(("config", "problem"), [
    ({"eos_token_id": "3"}, r"eos_token_id '3' is not a token id"),
    ({"eos_token_id": [3, True]}, r"eos_token_id True is not a token id"),
    ({"eos_token_id": -1}, r"eos_token_id -1 is not a token id"),
    ({"eos_token_id": [1, 4]}, r"eos_token_id 4 is outside the vocabulary of tokenizer\.json \(4 tokens\)"),
    ({"temperature": "hot"}, r"temperature='hot' is not a number"),
    ({"top_p": False}, r"top_p=False is not a number"),
    # Out of the engine's ranges: every request that did not override the default would fail.
    ({"temperature": -1}, r"invalid sampling parameter temperature=-1: must be >= 0"),
    ({"top_p": 7}, r"invalid sampling parameter top_p=7: must be in \(0, 1\]"),
    ({"repetition_penalty": 0}, r"invalid sampling parameter repetition_penalty=0: must be > 0"),
    ({"temperature": float("nan")}, r"invalid sampling parameter temperature=nan: must be finite"),
    ({"top_k": 1.5}, r"top_k=1\.5 is not an integer"),
])
def test_generation_config_fields_the_runtime_reads(tmp_path, registry, config, problem):
    files = {**_good_files(), "generation_config.json": json.dumps(config)}
    _convert_fails(tmp_path, registry, files, rf"generation_config\.json': {problem}")


@pytest.mark.parametrize(("config", "problem"), [
    ({"eos_token": 7}, r"eos_token 7 is not a string"),
    ({"eos_token": "</s>"}, r"eos_token '</s>' is not in the vocabulary of tokenizer\.json"),
    ({"eos_token": {"content": "</s>"}}, r"eos_token '</s>' is not in the vocabulary"),
])
def test_tokenizer_config_eos_token(tmp_path, registry, config, problem):
    files = {**_good_files(), "tokenizer_config.json": json.dumps(config)}
    _convert_fails(tmp_path, registry, files, rf"tokenizer_config\.json': {problem}")


def test_without_a_tokenizer_ids_are_only_type_checked(tmp_path, registry):
    files = {"tokenizer_config.json": json.dumps({"eos_token": "</s>"}),
             "generation_config.json": json.dumps({"eos_token_id": [151645, 151643], "do_sample": True})}
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), files=files)
    convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)
    files["generation_config.json"] = json.dumps({"eos_token_id": 1.5})
    _convert_fails(tmp_path / "bad", registry, files, r"generation_config\.json': eos_token_id 1\.5 is not a token id")


@pytest.mark.parametrize(("template", "problem"), [
    ("{% for m in messages %}{{ m }}", r"line 1: Unexpected end of template"),
    ("hello\n{{ messages | no_such_filter }}", r"line 2: No filter named 'no_such_filter'"),
    ("{% if messages %}{% endfor %}", r"line 1: Encountered unknown tag 'endfor'"),
])
def test_a_chat_template_that_is_not_valid_jinja(tmp_path, registry, template, problem):
    files = {**_good_files(), "chat_template.jinja": template}
    _convert_fails(tmp_path, registry, files, rf"chat_template\.jinja' is not a valid Jinja template: {problem}")


def test_a_chat_template_that_is_not_utf8(tmp_path, registry):
    files = {**_good_files(), "chat_template.jinja": b"{{ '\xff' }}"}
    _convert_fails(tmp_path, registry, files, r"chat_template\.jinja' is not UTF-8 text")


@pytest.mark.parametrize("holder", ["chat_template.json", "tokenizer_config.json"])
def test_a_derived_chat_template_names_the_file_it_comes_from(tmp_path, registry, holder):
    files = {**_good_files(), holder: json.dumps({"chat_template": "{% if x %}"})}
    del files["chat_template.jinja"]
    _convert_fails(tmp_path, registry, files,
                   rf"the chat_template of '[^']*{holder.replace('.', '[.]')}' is not a valid Jinja template: line 1")


def test_the_default_of_named_templates_is_checked(tmp_path, registry):
    named = [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": "{{ x "}]
    files = {**_good_files(), "tokenizer_config.json": json.dumps({"chat_template": named})}
    del files["chat_template.jinja"]
    _convert_fails(tmp_path, registry, files,
                   r"the 'default' chat_template of resource file '[^']*tokenizer_config\.json' is not a valid Jinja")
    # A chat_template.jinja beside them is what the runtime compiles: the list is not.
    files["chat_template.jinja"] = GOOD_TEMPLATE
    src = write_checkpoint(tmp_path / "ck2", synth_tensors(layers=1), files=files)
    convert(src, tmp_path / "m.ninfer", registry=registry, progress=False)


def test_cli_prints_one_line_and_exits_1(tmp_path, capsys, monkeypatch, registry):
    monkeypatch.setattr("ninfer.conversion.pipeline.get_registry", lambda: registry)
    files = {**_good_files(), "generation_config.json": "[]"}
    src = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), files=files)
    out = tmp_path / "m.ninfer"
    assert main([str(src), str(out), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("ninfer-convert: error: resource file ")
    assert "generation_config.json' must hold a JSON object, not an array" in captured.err
    assert not out.exists()
