"""The Python API as a user meets it (issue 29, item 8), on the embedded default model on the CPU.

``Engine.start()`` loads the default model; ``generate`` and ``submit`` take SamplingParams fields as
keywords (an unknown one is a TypeError naming it); ``chat`` renders the chat template and returns the
parsed output; a message list where a prompt is expected is a clear InvalidRequestError; and
docs/python-api.md states every default of SamplingParams, EngineOptions, OutputOptions and the
keywords of ``Engine.start`` / ``generate`` / ``chat``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from ninfer import Engine, EngineOptions, SamplingParams
from ninfer.contracts.errors import InvalidRequestError
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.sampling import InvalidSamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
SMALL = {"device": "cpu", "max_concurrency": 2, "max_context": 512}
MESSAGES = [{"role": "user", "content": "What does os.sep hold?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(default_artifact):
    with Engine.start(default_artifact, **SMALL) as e:
        yield e


@pytest.mark.parametrize("how", ["no argument", "None"])
def test_start_without_a_model_serves_the_default_model(default_model_cache, default_artifact, monkeypatch,
                                                         engine, how):
    monkeypatch.setenv("NINFER_CACHE_DIR", str(default_model_cache))
    before = sorted(default_model_cache.rglob("*.ninfer"))
    with (Engine.start(**SMALL) if how == "no argument" else Engine.start(None, **SMALL)) as default:
        timings = ("startup",)   # seconds by start-up phase: this start's own
        assert {k: v for k, v in default.info.items() if k not in timings} == \
            {k: v for k, v in engine.info.items() if k not in timings}
        out = default.generate("Hello", **GREEDY).token_ids
    assert out == engine.generate("Hello", **GREEDY).token_ids
    assert sorted(default_model_cache.rglob("*.ninfer")) == before == [default_artifact]  # looked up, not converted


def test_generate_and_submit_take_sampling_fields_as_keywords(engine):
    explicit = engine.generate("Hello", sampling=engine.sampling_params(**GREEDY))
    by_keywords = engine.generate("Hello", **GREEDY)
    assert by_keywords.finish_reason == "length" and len(by_keywords.token_ids) == 4
    assert by_keywords.token_ids == explicit.token_ids
    with engine.submit("Hello", temperature=0.0, max_tokens=2, ignore_eos=True) as handle:
        assert handle.result(60).token_ids == explicit.token_ids[:2]


def test_sampling_keywords_lie_over_the_model_defaults(engine):
    # The default model's generation_config sets top_k 20; a keyword changes only what it names.
    assert engine.sampling_params().top_k == 20
    seeded = {"max_tokens": 3, "seed": 7, "ignore_eos": True}
    assert engine.generate("Hello", **seeded).token_ids == engine.generate(
        "Hello", sampling=engine.sampling_params(**seeded)).token_ids


def test_an_unknown_or_doubled_sampling_keyword_is_a_type_error(engine):
    with pytest.raises(TypeError, match=r"'temprature'.*temperature"):
        engine.generate("Hello", temprature=0.0)
    with pytest.raises(TypeError, match=r"'stop'.*OutputOptions\(stop="):
        engine.submit("Hello", stop=["\n"])
    with pytest.raises(TypeError, match="either sampling=.* or sampling keywords"):
        engine.generate("Hello", sampling=SamplingParams(), max_tokens=2)
    with pytest.raises(InvalidSamplingParams, match="max_tokens=0"):
        engine.generate("Hello", max_tokens=0)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams.*got dict"):
        engine.submit("Hello", sampling={"temperature": 0.0})
    assert engine.stats().outstanding == 0


@pytest.mark.parametrize("prompt", [MESSAGES, MESSAGES[0], tuple(MESSAGES)])
def test_a_message_list_as_a_prompt_points_to_chat(engine, prompt):
    with pytest.raises(InvalidRequestError, match=r"chat messages: use engine\.chat\(messages"):
        engine.generate(prompt, max_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"engine\.chat"):
        engine.submit(prompt)
    assert engine.stats().outstanding == 0


def test_chat_renders_the_template_and_returns_the_parsed_output(engine):
    result = engine.chat(MESSAGES, enable_thinking=False, **GREEDY)
    prompt = engine.frontend.prepare_chat(MESSAGES, enable_thinking=False)
    same = engine.generate(prompt, output=OutputOptions(), **GREEDY)
    assert result.usage.prompt_tokens == len(prompt.token_ids)
    assert result.token_ids == same.token_ids
    assert result.output == same.output
    assert result.output.reasoning == "" and result.output.content == engine.frontend.decode(result.token_ids)


def test_chat_with_thinking_parses_the_reasoning_channel(engine):
    prompt = engine.frontend.prepare_chat(MESSAGES)  # enable_thinking defaults to True
    assert prompt.thinking_open
    result = engine.chat(MESSAGES, **GREEDY)
    assert result.usage.prompt_tokens == len(prompt.token_ids)
    same = engine.generate(prompt, **GREEDY)
    assert result.token_ids == same.token_ids and result.output == same.output
    text = engine.frontend.decode(result.token_ids)
    assert "</think>" not in text  # four tokens stay inside the reasoning: all of it is reasoning
    assert result.output.content == "" and result.output.reasoning == text


def test_chat_renders_tools_into_the_prompt_and_hands_them_to_the_parser(engine):
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time now",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with_tools = engine.frontend.prepare_chat(MESSAGES, tools=tools, enable_thinking=False)
    assert len(with_tools.token_ids) > len(engine.frontend.prepare_chat(MESSAGES, enable_thinking=False).token_ids)
    result = engine.chat(MESSAGES, tools=tools, enable_thinking=False, max_tokens=1, temperature=0.0)
    assert result.usage.prompt_tokens == len(with_tools.token_ids)


@pytest.mark.parametrize("messages, match", [
    ("What does os.sep hold?", r"plain text prompt goes to generate\(\)"),
    ([], "non-empty list of messages"),
    (MESSAGES[0], "non-empty list of messages"),
    ([{"content": "no role"}], "message 0 must be a mapping with a 'role'"),
])
def test_chat_refuses_what_is_not_a_message_list(engine, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.chat(messages, max_tokens=2)
    assert engine.stats().outstanding == 0


def _documented_defaults() -> dict[str, str]:
    """``name -> default`` from every table row of docs/python-api.md that reads ``| `name` | `default` |``."""
    rows = re.findall(r"^\| `([a-z_]+)` \| `([^`]*)` \|", DOCS.read_text(encoding="utf-8"), flags=re.M)
    return dict(rows)


def _declared_defaults() -> dict[str, object]:
    declared: dict[str, object] = {}
    for cls in (SamplingParams, EngineOptions, OutputOptions):
        for f in dataclasses.fields(cls):
            declared[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    for fn in (Engine.start, Engine.submit, Engine.generate, Engine.chat):
        for p in inspect.signature(fn).parameters.values():
            if p.default is not inspect.Parameter.empty:
                declared.setdefault(p.name, p.default)
    return declared


def test_the_docs_state_every_default():
    documented = _documented_defaults()
    for name, default in _declared_defaults().items():
        assert name in documented, f"docs/python-api.md has no default row for {name!r}"
        assert documented[name] == repr(default), (name, documented[name], default)
