"""Session hints: a request's session key binds its newest checkpoint unless a newer request (later
submission = higher publication order) already published under it; over HTTP the OpenAI
``prompt_cache_key`` field carries the key, and /metrics exports the Host tier and Snapshot counters."""

from __future__ import annotations

import random

import pytest
from ninfer.contracts.errors import InvalidRequestError
from ninfer.contracts.request import GenerationRequest
from ninfer.contracts.sampling import SamplingParams

from .conftest import settled
from .test_engine_cache import toks


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=0)


def test_an_older_request_finishing_late_does_not_overwrite_the_session(make_engine):
    rng = random.Random(21)
    engine = make_engine(max_context=256, max_concurrency=2, prefill_chunk_size=32, context_cache=True,
                         cache_checkpoint_interval=16)
    cache = engine._core.cache
    old_prompt, new_prompt = toks(rng, 20), toks(rng, 24)
    older = engine.submit(old_prompt, sampling=greedy(40), session="chat-1")   # submitted first, runs long
    newer = engine.submit(new_prompt, sampling=greedy(2), session="chat-1")    # submitted second, ends first
    new_out = newer.result(60).token_ids
    old_out = older.result(60).token_ids
    newer.release()
    older.release()
    settled(engine)
    old_end = cache.index.find(tuple(old_prompt) + old_out[:-1])
    new_end = cache.index.find(tuple(new_prompt) + new_out[:-1])
    assert old_end is not None and new_end is not None  # both response ends were published...
    bound = cache.session_entry("chat-1")
    assert bound.entry_id == new_end  # ...but the late older one did not take the binding
    assert cache.entries()[-1].entry_id == old_end  # it did publish last (most recently used)
    # The bound entry is retained with priority: it is the last shared entry reclaim would take.
    assert cache._ordered_shared()[-1].entry_id == new_end
    # A request submitted later still moves the binding forward.
    third_prompt = toks(rng, 18)
    third_out = engine.generate(third_prompt, sampling=greedy(3), session="chat-1").token_ids
    settled(engine)
    assert cache.session_entry("chat-1").entry_id == cache.index.find(tuple(third_prompt) + third_out[:-1])


def test_session_key_validation():
    with pytest.raises(InvalidRequestError):
        GenerationRequest(prompt=[1, 2], session="").validate(vocab_size=10, max_context=10)
    with pytest.raises(InvalidRequestError):
        GenerationRequest(prompt=[1, 2], session="x" * 257).validate(vocab_size=10, max_context=10)
    GenerationRequest(prompt=[1, 2], session="conversation-7").validate(vocab_size=10, max_context=10)


@pytest.mark.parametrize("points", [(0,), (3,), (2, 1), (1, 1), (True,)])
def test_cache_points_validation(points):
    from ninfer.contracts.frontend import PreparedPrompt

    with pytest.raises(InvalidRequestError):
        GenerationRequest(prompt=PreparedPrompt((1, 2, 3), cache_points=points)).validate(vocab_size=10, max_context=10)


def test_prompt_cache_key_over_http_binds_the_session_and_metrics_report_the_cache(make_engine):
    pytest.importorskip("ninfer_serve")
    from litestar.testing import TestClient
    from ninfer_serve import Gateway, ServeConfig, create_app
    from prometheus_client.parser import text_string_to_metric_families

    engine = make_engine(max_context=512, max_concurrency=1, prefill_chunk_size=64, context_cache=True,
                         cache_host_mib=1)
    with TestClient(create_app(Gateway(engine, ServeConfig(model_id="tiny")))) as client:
        body = {"model": "tiny", "prompt": "hello there, a completion with a session", "max_tokens": 3,
                "temperature": 0, "prompt_cache_key": "user-42"}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert client.post("/v1/completions", json={**body, "prompt_cache_key": ""}).status_code == 400
        settled(engine)
        bound = engine._core.cache.session_entry("user-42")
        assert bound is not None and bound.kind == "response_end"
        text = client.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("ninfer_context_cache_demotions_total", "ninfer_context_cache_restores_total",
                 "ninfer_snapshot_pauses_total", "ninfer_snapshot_revocations_total", "ninfer_replays_total",
                 "ninfer_context_cache_host_bytes"):
        assert samples[name] == 0, name
    assert samples["ninfer_context_cache_host_budget_bytes"] == 2**20
    assert samples["ninfer_context_cache_checkpoints"] >= 2
