"""The Python API refuses a wrongly typed value on the caller's thread, naming it, and no other request is harmed.

Before these checks a float ``max_tokens`` or a truthy string reached the engine worker, where it failed the whole
step (every running request ended with EngineFailure and the engine accepted nothing more) or silently meant
something else (``ignore_eos="no"`` is true, a bare stop string was a set of characters, bytes were token ids).
On the embedded default model on the CPU.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from ninfer import Engine, SamplingParams
from ninfer.contracts.errors import InvalidRequestError
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.options import EngineOptions, InvalidEngineOptions
from ninfer.contracts.request import GenerationRequest
from ninfer.contracts.sampling import InvalidSamplingParams

SMALL = {"device": "cpu", "max_concurrency": 2, "max_context": 512}
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def engine(default_artifact):
    with Engine.start(default_artifact, **SMALL) as e:
        yield e


@pytest.mark.parametrize("fields, match", [
    ({"max_tokens": 1e3}, r"max_tokens=1000\.0: must be an integer, not float"),
    ({"max_tokens": np.float64(5)}, r"max_tokens=.*must be an integer, not float64"),
    ({"max_tokens": None}, r"max_tokens=None: must be an integer, not NoneType"),
    ({"logprobs": True, "top_logprobs": 2.5}, r"top_logprobs=2\.5: must be an integer"),
    ({"logprobs": True, "top_logprobs": True}, r"top_logprobs=True: must be an integer, not bool"),
    ({"ignore_eos": "no"}, r"ignore_eos='no': must be True or False, not str"),
    ({"temperature": "0.5"}, r"temperature='0\.5': must be a number, not str"),
    ({"seed": 1.5}, r"seed=1\.5: must be an integer or None, not float"),
    ({"stop_token_ids": [1.5]}, r"stop_token_ids=\(1\.5,\): every item must be an integer, not float"),
])
def test_a_wrongly_typed_sampling_value_is_refused_and_harms_no_other_request(engine, fields, match):
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    alone = engine.generate(PROMPT, **greedy).token_ids
    other = engine.submit(PROMPT, **greedy)
    with pytest.raises(InvalidSamplingParams, match=match):
        engine.generate("def f(", **fields)
    with pytest.raises(InvalidSamplingParams, match=match):
        engine.generate("def f(", sampling=SamplingParams(**{"max_tokens": 4, **fields}))
    assert other.result(timeout=120).token_ids == alone
    assert engine.stats().status == "running"
    assert engine.generate(PROMPT, **greedy).token_ids == alone


@pytest.mark.parametrize("kwargs, error, match", [
    ({"output": {"stop": ["x"]}}, TypeError, "output must be an OutputOptions"),
    ({"output": OutputOptions(stop_token_ids=(1,))}, None, None),
    ({"timeout_s": "5"}, TypeError, r"timeout_s \(seconds\) must be a number or None, not str"),
    ({"deadline": "x"}, TypeError, r"deadline \(seconds\) must be a number or None, not str"),
    ({"request_id": 123}, InvalidRequestError, "invalid request field request_id=123: must be a string or None, "
                                               "not int"),
    ({"cache": "no"}, InvalidRequestError, "invalid request field cache='no': must be True or False, not str"),
])
def test_request_keywords_are_typed(engine, kwargs, error, match):
    if error is None:
        assert engine.generate("x", max_tokens=2, **kwargs).finish_reason in ("stop", "length")
        return
    submitted = engine.stats().submitted
    with pytest.raises(error, match=match):
        engine.generate("x", max_tokens=2, **kwargs)
    assert engine.stats().submitted == submitted   # refused before anything was queued


@pytest.mark.parametrize("options, match", [
    ({"stop": (5,)}, r"stop=\(5,\): every item must be a string, not int"),
    ({"stop": (b"x",)}, r"every item must be a string, not bytes"),
    ({"stop": None}, r"stop=None: must be a sequence of str values"),
    ({"stop": ("",)}, "a stop string must not be empty"),
    ({"ignore_eos": "no"}, r"ignore_eos='no': must be True or False"),
    ({"min_tokens": -1}, r"min_tokens=-1: must be >= 0"),
    ({"min_tokens": 1.0}, r"min_tokens=1\.0: must be an integer"),
    ({"tools": "x"}, "tools: must be a sequence of tool specs"),
    ({"tools": None}, "tools: must be a sequence of tool specs"),
    ({"constraint": "json"}, "constraint: must be an OutputConstraint"),
])
def test_output_options_are_typed(options, match):
    with pytest.raises(InvalidRequestError, match=match):
        OutputOptions(**options)


def test_a_bare_stop_string_is_one_stop_string(engine):
    """vLLM's reading: ``stop="ab"`` stops at "ab", not at "a" or "b"."""
    assert OutputOptions(stop="Return").stop == ("Return",)
    assert OutputOptions(stop=["a", "b"]).stop == ("a", "b")
    greedy = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    plain = {"parse_reasoning": False, "parse_tool_calls": False}
    text = engine.generate(PROMPT, output=OutputOptions(**plain), **greedy).output.content
    word = next(w for w in text.split() if len(w) >= 3)
    out = engine.generate(PROMPT, output=OutputOptions(stop=word, **plain), **greedy)
    assert out.finish_reason == "stop" and out.output.content == text[:text.index(word)]


@pytest.mark.parametrize("prompt, match", [
    (b"def f", "the prompt is bytes: decode it to a str"),
    (np.array([[1, 2]]), r"must be a 1-D array of integer token ids, got ndarray of dtype int64 and shape \(1, 2\)"),
    (np.array([1.5]), r"of dtype float64"),
    ([np.int64(5)], r"prompt token np\.int64\(5\) is a int64, not a Python int"),
])
def test_prompts_of_the_wrong_kind_are_named(engine, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(prompt, max_tokens=2)


@pytest.mark.parametrize("make", [lambda ids: np.array(ids), lambda ids: torch.tensor(ids)])
def test_token_ids_as_a_1d_integer_array_are_token_ids(engine, make):
    ids = engine.frontend.prepare_text(PROMPT).token_ids
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    assert engine.generate(make(list(ids)), **greedy).token_ids == engine.generate(list(ids), **greedy).token_ids


def test_generation_request_fields_are_typed():
    with pytest.raises(InvalidRequestError, match="GenerationRequest.prompt is token ids or a PreparedPrompt, not str"):
        GenerationRequest(prompt="hello")
    with pytest.raises(InvalidRequestError, match="sampling must be a SamplingParams or None, got dict"):
        GenerationRequest(prompt=[1], sampling={"temperature": 0})
    with pytest.raises(InvalidRequestError, match="invalid request field cache='no': must be True or False"):
        GenerationRequest(prompt=[1], cache="no")
    with pytest.raises(InvalidRequestError, match="invalid request field deadline='soon': must be a number or None"):
        GenerationRequest(prompt=[1], deadline="soon")


@pytest.mark.parametrize("kwargs, match", [
    ({"tools": "x"}, "tools must be a list of function specs, got str"),
    ({"tools": [5]}, "tool 0 must be a mapping"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "with a non-empty name"),
])
def test_chat_tools_are_checked_before_rendering(engine, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.chat([{"role": "user", "content": "hi"}], max_tokens=2, **kwargs)


def test_chat_enable_thinking_must_be_a_bool(engine):
    with pytest.raises(TypeError, match="enable_thinking must be True or False, got str 'no'"):
        engine.chat([{"role": "user", "content": "hi"}], max_tokens=2, enable_thinking="no")


@pytest.mark.parametrize("overrides, match", [
    ({"max_concurrency": "4"}, r"max_concurrency='4': must be an integer, not str"),
    ({"max_context": 100.5}, r"max_context=100\.5: must be an integer, not float"),
    ({"context_cache": "no"}, r"context_cache='no': must be True, False or None, not str"),
    ({"warmup": "yes"}, r"warmup='yes': must be True, False or None"),
    ({"queue_capacity": 1.5}, r"queue_capacity=1\.5: must be an integer"),
    ({"page_size": 1_000_000}, r"page_size=1000000: must be in 1\.\.1024"),
])
def test_engine_options_are_typed_before_anything_loads(overrides, match):
    with pytest.raises(InvalidEngineOptions, match=match):
        Engine.start("/nonexistent/model.ninfer", **overrides)
    with pytest.raises(InvalidEngineOptions, match=match):
        EngineOptions(**overrides).validate()


def test_engine_start_refuses_an_empty_model_and_a_dict_of_options():
    with pytest.raises(InvalidEngineOptions, match="the model is an empty string"):
        Engine.start("")
    with pytest.raises(TypeError, match="options must be an EngineOptions"):
        Engine.start(options={"max_context": 64})


def test_clear_context_cache_after_close_is_a_no_op(default_artifact):
    e = Engine.start(default_artifact, **SMALL)
    e.close()
    e.clear_context_cache()   # documented: no-op after close


def test_score_from_its_own_progress_callback_is_refused_not_a_deadlock(default_artifact):
    from ninfer.scoring.windows import InvalidScoringOptions

    errors: list[Exception] = []

    with Engine.start(default_artifact, device="cpu", purpose="causal_scoring", max_context=64) as scorer:
        def progress(done: int, total: int) -> None:
            if not errors:
                try:
                    scorer.score(["x y"])
                except InvalidScoringOptions as exc:
                    errors.append(exc)

        finished = threading.Event()
        report = []

        def run() -> None:
            report.append(scorer.score(["hello world " * 4], progress=progress))
            finished.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert finished.wait(120), "score() deadlocked on its own progress callback"
        assert report[0].texts[0].scored_tokens > 0
        assert "called from inside a score() call on the same thread" in str(errors[0])
        assert scorer.score(["x y z"]).texts[0].scored_tokens > 0   # the scorer still works


def test_numpy_scalars_and_a_torch_device_stand_for_their_python_types(engine):
    """A numpy integer is an int and a numpy float a float (turned into Python's own at construction), as they
    were before the type checks; a torch.device names the device."""
    params = SamplingParams(seed=np.int64(5), max_tokens=np.int32(3), temperature=np.float32(0.5),
                            stop_token_ids=[np.int64(7)])
    assert (type(params.seed), type(params.max_tokens), type(params.temperature)) == (int, int, float)
    assert params.stop_token_ids == (7,) and type(params.stop_token_ids[0]) is int
    assert params.validate() is params
    greedy = {"temperature": 0.0, "ignore_eos": True}
    assert (engine.generate(PROMPT, max_tokens=np.int64(3), **greedy).token_ids
            == engine.generate(PROMPT, max_tokens=3, **greedy).token_ids)
    assert EngineOptions(device=torch.device("cpu")).validate().device == "cpu"


def test_a_sequence_of_ints_without_a_dtype_is_token_ids(engine):
    import array

    ids = list(engine.frontend.prepare_text(PROMPT).token_ids)
    greedy = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    assert engine.generate(array.array("l", ids), **greedy).token_ids == engine.generate(ids, **greedy).token_ids
