"""EngineOptions resolved once (``ninfer.planning.resolution``), and one plan read by every surface: the
purpose rules, the max_context cap, the prefill chunk, explicit KV pools, lookahead spares, and an engine
that serves exactly what ``plan`` (and so ``ninfer info --memory``) says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ninfer import Engine
from ninfer.contracts.options import EngineOptions, InvalidEngineOptions
from ninfer.planning import resolution
from ninfer.planning.budget import BUDGET_ENV
from ninfer.planning.planner import plan

from tests.startup.test_planner import PROFILE

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def resolve(options: EngineOptions, device: torch.device = CPU, *, lookahead_supported: bool = False):
    return resolution.resolve_options(options, device=device, dtype=torch.float32, profile=PROFILE,
                                      lookahead_supported=lookahead_supported)


def test_the_purpose_rule_is_one_idempotent_method():
    scoring = EngineOptions(purpose="causal_scoring", max_concurrency=4)
    assert scoring.for_purpose().max_concurrency == 1
    assert scoring.for_purpose().for_purpose() == scoring.for_purpose()
    assert scoring.for_purpose().context_cache is False  # the default: scoring keeps no context cache
    generation = EngineOptions(max_concurrency=4).for_purpose()
    assert generation.context_cache is True  # the default: on for generation
    assert generation.for_purpose() is generation


def test_every_default_and_rule_is_applied_in_the_resolved_options():
    r = resolve(EngineOptions(purpose="causal_scoring", max_concurrency=4, max_context=100_000))
    o = r.options
    positions = PROFILE.max_position_embeddings
    assert (o.max_concurrency, o.max_context, o.prefill_chunk_size) == (1, positions, 2048)
    assert (o.device, o.dtype, r.device, r.dtype) == ("cpu", "float32", CPU, torch.float32)
    assert (r.explicit_pages, r.graph_batches, r.lookahead_slots, o.num_pages) == (None, 0, 0, None)
    g = resolve(EngineOptions(max_concurrency=3, max_context=1000, prefill_chunk_size=300))
    assert (g.options.max_concurrency, g.options.max_context, g.options.prefill_chunk_size) == (3, 1000, 300)
    # What the Program and the engine are given: the same resolved figures.
    p = g.program_options(77)
    assert (p.device, p.dtype, p.max_sequences, p.num_pages, p.max_context, p.lookahead_slots) \
        == (CPU, torch.float32, 3, 77, 1000, 0)
    assert g.engine_options(77) == dataclasses.replace(g.options, num_pages=77)


def test_an_explicit_pool_is_resolved_and_must_hold_one_request():
    assert resolve(EngineOptions(num_pages=300, kv_budget_mib=1)).explicit_pages == 300   # num_pages wins
    # 4.6875 MiB of 1 KiB tokens in 16-token pages: 300 pages.
    assert resolve(EngineOptions(kv_budget_mib=4.6875)).explicit_pages == 300
    with pytest.raises(InvalidEngineOptions,
                       match="the KV pool of 10 pages x 16 tokens cannot hold one request of max_context 4096"):
        resolve(EngineOptions(num_pages=10))


def test_graphs_and_lookahead_spares_follow_the_device_and_the_architecture(monkeypatch):
    monkeypatch.delenv(resolution.GRAPHS_ENV, raising=False)
    on_cuda = resolve(EngineOptions(max_concurrency=3), CUDA, lookahead_supported=True)
    assert (on_cuda.graph_batches, on_cuda.lookahead_slots) == (3, 3)
    assert resolve(EngineOptions(max_concurrency=3), CUDA).lookahead_slots == 0           # not supported
    assert resolve(EngineOptions(max_concurrency=3, lookahead=False), CUDA,
                   lookahead_supported=True).lookahead_slots == 0
    forced = resolve(EngineOptions(max_concurrency=3, lookahead=True), lookahead_supported=True)
    assert (forced.graph_batches, forced.lookahead_slots) == (0, 3)
    with pytest.raises(InvalidEngineOptions, match="lookahead=True: this architecture's Program does not"):
        resolve(EngineOptions(lookahead=True))
    scoring = resolve(EngineOptions(purpose="causal_scoring"), CUDA, lookahead_supported=True)
    assert (scoring.graph_batches, scoring.lookahead_slots) == (0, 0)


@pytest.mark.parametrize("options", [
    EngineOptions(device="cpu", max_concurrency=3, max_context=100_000, prefill_chunk_size=300),
    EngineOptions(device="cpu", purpose="causal_scoring", max_concurrency=4, max_context=512),
], ids=["generation", "causal_scoring"])
def test_the_engine_serves_the_plan(default_artifact, monkeypatch, options):
    """Engine.start builds exactly what ``plan`` (the ``ninfer info --memory`` plan) says: the same resolved
    options and the same sizes; its summary differs only in what it measured."""
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    planned = plan(default_artifact, options)
    with Engine.start(default_artifact, options) as engine:
        assert engine.options == planned.options.engine_options(planned.memory.num_pages)
        measured = engine.memory_summary()
        assert measured.measured and not planned.summary().measured
        assert dataclasses.replace(measured, measured=False,
                                   startup_retained_bytes=planned.summary().startup_retained_bytes) \
            == planned.summary()
        assert engine.stats().state_slots_total == planned.options.options.max_concurrency
    assert planned.options.options.max_concurrency == (1 if options.purpose == "causal_scoring" else 3)
