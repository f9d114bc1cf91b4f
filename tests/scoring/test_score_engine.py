"""The causal_scoring purpose through the public Engine: dispatch, sizing, isolation, bad input, report."""

from __future__ import annotations

import json
import logging
import math
import threading

import pytest
from ninfer import Engine
from ninfer.contracts.errors import EngineClosedError
from ninfer.contracts.program import ProgramCapacity
from ninfer.errors import NotSupportedError
from ninfer.scoring import InvalidScoringInput, InvalidScoringOptions, ScoreInput

from .conftest import MAX_POSITIONS, start_scorer

TEXT = "for i in range(10):\n    print(i * i)\n"


@pytest.fixture(scope="module")
def engine(scoring_model):
    with start_scorer(scoring_model("dense").artifact) as e:
        yield e


def test_scoring_engine_refuses_submit(engine):
    with pytest.raises(NotSupportedError, match="causal_scoring"):
        engine.submit("hello")
    with pytest.raises(NotSupportedError, match="causal_scoring"):
        engine.generate([1, 2, 3])


def test_generation_engine_refuses_score(scoring_model):
    with Engine.start(scoring_model("dense").artifact, device="cpu", dtype="float32", max_context=16,
                      page_size=4) as gen:
        with pytest.raises(NotSupportedError, match="purpose 'causal_scoring'"):
            gen.score("hello")


def test_scoring_engine_has_one_sequence_one_window_and_no_worker(scoring_model):
    before = {t.name for t in threading.enumerate()}
    with start_scorer(scoring_model("dense").artifact, max_concurrency=4) as e:
        assert e.purpose == "causal_scoring" and e.options.max_concurrency == 1
        assert "ninfer-engine-worker" not in {t.name for t in threading.enumerate()} - before
        s = e.stats()
        assert s.state_slots_total == 1
        assert s.pages_total * s.page_size == 16  # KV for exactly one window of max_context
        e.score([TEXT, "x" * 40], context=16, stride=8)
        s = e.stats()
        assert s.pages_used == 0 and s.state_slots_used == 0  # every window released
        assert s.units > 0 and s.prefill_tokens > 0
    assert e.closed and e.stats().status == "closed"
    with pytest.raises(EngineClosedError):
        e.score(TEXT)


def test_a_program_without_score_chunk_cannot_score():
    class NoScoring:
        vocab_size = 10
        max_context = 64
        device = "cpu"
        dtype = None

        def capacity(self):
            return ProgramCapacity(total_pages=16, free_pages=16, total_state_slots=1, free_state_slots=1,
                                   page_size=4)

    class Fe:
        vocab_size = 10

        def sampling_defaults(self):
            return {}

    with pytest.raises(NotSupportedError, match="score_chunk"):
        Engine.from_parts(NoScoring(), Fe(), purpose="causal_scoring", max_context=16)


def test_defaults_are_max_context_and_half_stride(engine):
    report = engine.score(TEXT)
    assert (report.settings.context, report.settings.stride) == (16, 8)
    assert (report.settings.dtype, report.settings.device) == ("float32", "cpu")


def test_windows_and_texts_do_not_share_state(engine):
    """Every window starts from an empty State and KV: a text's scores are bit-identical alone, after
    other texts, and repeated."""
    other = "import os\nimport sys\n" * 3
    alone = engine.score(TEXT, context=16, stride=5, logprobs=True).texts[0]
    mixed = engine.score([other, TEXT, other, TEXT], context=16, stride=5, logprobs=True).texts
    assert mixed[1].nll == alone.nll and mixed[3].nll == alone.nll
    assert mixed[1].token_logprobs == alone.token_logprobs
    assert mixed[0].nll == mixed[2].nll


def test_text_and_token_inputs_agree(engine):
    tokens = engine.frontend.encode(TEXT)
    by_text = engine.score(ScoreInput(text=TEXT, id="t"), context=16, stride=8).texts[0]
    by_tokens = engine.score([tokens], context=16, stride=8).texts[0]
    assert by_text.id == "t" and by_tokens.id is None
    assert by_text.nll == by_tokens.nll and by_text.input_tokens == len(tokens)


@pytest.mark.parametrize("text, n", [("", 0), ("a", 1)])
def test_texts_with_no_target_score_zero_tokens_with_null_perplexity(engine, text, n):
    report = engine.score([text], logprobs=True)
    (t,) = report.texts
    assert (t.input_tokens, t.scored_tokens, t.windows, t.nll) == (n, 0, 0, 0.0)
    assert t.mean_nll is None and t.perplexity is None and t.token_logprobs == ()
    data = json.loads(report.to_json())
    assert data["texts"][0]["perplexity"] is None and data["overall"]["perplexity"] is None


def test_empty_texts_do_not_change_the_aggregate(engine):
    with_empty = engine.score(["", TEXT, "b"]).overall
    alone = engine.score(TEXT).overall
    assert (with_empty.scored_tokens, with_empty.nll, with_empty.perplexity) == (
        alone.scored_tokens, alone.nll, alone.perplexity)
    assert with_empty.texts == 3 and with_empty.input_tokens == alone.input_tokens + 1


@pytest.mark.parametrize("inputs, match", [
    ([], "nothing to score"),
    (b"abc", "bytes"),
    (["ok", b"abc"], "input 1 is bytes"),
    ("bad \ud800 surrogate", "not valid Unicode"),
    ([[1, 2, 999]], r"token ids \[999\] are outside the vocabulary"),
    ([[1, -1]], "outside the vocabulary"),
    (3.5, "expected a str"),
    ([{"text": "a"}], "expected a str, a token list or a ScoreInput"),
])
def test_bad_inputs_are_refused(engine, inputs, match):
    with pytest.raises(InvalidScoringInput, match=match):
        engine.score(inputs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(context=8, stride=9), "stride=9: it exceeds context=8"),
    (dict(context=0), "context=0"),
    (dict(context=8, stride=0), "stride=0"),
    (dict(context=17), "context=17: it exceeds this engine's max_context 16"),
    (dict(top_logprobs=3), "top_logprobs needs logprobs=True"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs=-1"),
    (dict(logprobs=True, top_logprobs=10**9), r"top_logprobs=1000000000: it exceeds the vocabulary \(\d+ tokens\)"),
])
def test_bad_options_are_refused(engine, kwargs, match):
    with pytest.raises(InvalidScoringOptions, match=match):
        engine.score(TEXT, **kwargs)


def test_context_beyond_the_model_positions_is_refused(scoring_model, caplog):
    with caplog.at_level(logging.WARNING, logger="ninfer.engine"):
        e = start_scorer(scoring_model("dense").artifact, max_context=4 * MAX_POSITIONS)
    with e:
        assert e.max_context == MAX_POSITIONS
        with pytest.raises(InvalidScoringOptions, match=f"the model has {MAX_POSITIONS} positions"):
            e.score(TEXT, context=MAX_POSITIONS + 1)
        # The model's full context is usable.
        assert e.score("z" * (MAX_POSITIONS + 5), context=MAX_POSITIONS).texts[0].windows == 2
    assert any("exceeds the model's" in r.message for r in caplog.records)


def test_the_default_context_capped_to_the_model_is_no_warning(scoring_model, caplog):
    """Only a length the caller chose is worth a warning when capped; the default (4,096) capped to a small model's
    positions is said at INFO."""
    from ninfer import Engine

    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        with Engine.start(scoring_model("dense").artifact, device="cpu", dtype="float32", purpose="causal_scoring",
                          page_size=4, prefill_chunk_size=5) as e:
            assert e.max_context == MAX_POSITIONS
    capped = [r for r in caplog.records if "exceeds the model's" in r.message]
    assert capped and all(r.levelno == logging.INFO for r in capped)


def test_progress_counts_target_tokens(engine):
    calls = []
    engine.score([TEXT, "", "hello world"], context=16, stride=4, progress=lambda d, t: calls.append((d, t)))
    total = len(engine.frontend.encode(TEXT)) - 1 + len("hello world") - 1
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:], strict=False))


def test_report_json(engine):
    report = engine.score([ScoreInput(text=TEXT, id="a"), "second text"], context=12, stride=6, logprobs=True,
                          top_logprobs=2)
    data = json.loads(report.to_json())
    assert data["schema"] == "ninfer.score_report/1"
    assert data["settings"] == {"context": 12, "stride": 6, "dtype": "float32", "device": "cpu",
                                "prefill_chunk_size": 5, "logprobs": True, "top_logprobs": 2}
    art = data["artifact"]
    assert art["architecture"] == "Qwen3_5ForCausalLM" and art["artifact_id"] and art["name"]
    assert [t["id"] for t in data["texts"]] == ["a", None]
    t0 = data["texts"][0]
    assert len(t0["token_logprobs"]) == t0["scored_tokens"]
    assert all(len(e["top"]) == 2 and e["top"][0][1] >= e["logprob"] for e in t0["token_logprobs"])
    assert t0["perplexity"] == pytest.approx(math.exp(t0["nll"] / t0["scored_tokens"]), rel=1e-12)
    o = data["overall"]
    assert o["scored_tokens"] == sum(t["scored_tokens"] for t in data["texts"])
    assert o["perplexity"] == pytest.approx(math.exp(o["nll"] / o["scored_tokens"]), rel=1e-12)
    assert data["timing"]["processed_tokens"] >= o["scored_tokens"]
    assert "token_logprobs" not in json.loads(engine.score(TEXT).to_json())["texts"][0]
