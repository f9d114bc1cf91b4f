"""``POST /reset_prefix_cache``: the context cache's checkpoints are dropped, nothing else is touched."""

from __future__ import annotations

from serve_helpers import chat, client_for, wait_idle


def test_reset_drops_every_checkpoint_and_the_next_turn_computes_its_prompt(engine):
    wait_idle(engine)
    with client_for(engine) as c:
        body = chat("Say something about queues.", max_tokens=4, temperature=0)
        first = c.post("/v1/chat/completions", json=body).json()
        again = c.post("/v1/chat/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # the checkpoint of turn 1 hit
        assert engine.stats().cache_checkpoints > 0
        r = c.post("/reset_prefix_cache")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        s = engine.stats()
        assert (s.cache_checkpoints, s.pages_used, s.state_slots_used, s.cache_host_bytes) == (0, 0, 0, 0)
        cold = c.post("/v1/chat/completions", json=body).json()
    assert (cold["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0
    assert cold["choices"][0]["message"] == first["choices"][0]["message"]
