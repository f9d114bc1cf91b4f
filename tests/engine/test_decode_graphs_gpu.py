"""Decode CUDA graphs (issue 8 item 2): one graph per exact batch size 1..max_concurrency, page tables,
positions and state slots as inputs; tokens and logprobs equal to the eager path, bit for bit."""

from __future__ import annotations

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(3 + 5 * i)] for i in range(6)]


def start(artifact, dtype, **options) -> Engine:
    # Decode graphs alone: a prefill-step graph runs its step's chunks in their flat form, whose bits differ from the
    # eager step's (tests/engine/test_flat_steps_engine.py compares those).
    return Engine.start(artifact, EngineOptions(device="cuda", dtype=dtype, max_context=96, page_size=4,
                                                max_concurrency=4, prefill_graphs=False, **options))


def reserved_after_collecting() -> int:
    """The allocator's reserved bytes once what earlier engines left to the garbage collector is gone. Without
    this an earlier engine's graph pool, still held by a reference cycle, is freed inside the next engine's
    capture (torch.cuda.graph collects garbage when a capture begins) and offsets that capture's growth."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def submit_all(engine: Engine, sp: SamplingParams) -> list:
    """Submit every prompt with the same step composition in every run: the worker is held inside the first
    request's prefill while the others are submitted. Bitwise equality needs the same prefill packing too (a
    prefill of several sequences rounds differently from the same sequences apart), and admission takes
    whatever has arrived when a step is scheduled."""
    from .test_multi_prefill import hold_forward

    gate, entered = hold_forward(engine._program)  # noqa: SLF001
    gate.clear()
    handles = [engine.submit(PROMPTS[0], sampling=sp)]
    assert entered.wait(60)
    handles += [engine.submit(p, sampling=sp) for p in PROMPTS[1:]]
    gate.set()
    return handles


def run(engine: Engine, seeded: bool) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    sp = (SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True, logprobs=True)
          if seeded else SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True))
    handles = submit_all(engine, sp)
    out = []
    for h in handles:
        with h:
            lps = [lp.logprob for ev in h if isinstance(ev, GenerationDelta) for lp in (ev.logprobs or ())]
            r = h.result()
        assert len(lps) == len(r.token_ids) == 24
        out.append((tuple(r.token_ids), tuple(lps)))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager_bitwise(tiny_qwen_artifact, monkeypatch, dtype):
    import torch

    before = reserved_after_collecting()
    with start(tiny_qwen_artifact, dtype) as engine:
        assert engine.info["cuda_graphs"] == [1, 2, 3, 4]
        growth = engine.memory_summary().graph_final_growth_bytes
        # The graphs' pool is part of what the start reserved, measured here independently of the engine.
        assert 0 < growth <= torch.cuda.memory_reserved() - before
        graphed = [run(engine, False), run(engine, True)]
    monkeypatch.setenv("NINFER_CUDA_GRAPHS", "0")
    reserved_after_collecting()
    with start(tiny_qwen_artifact, dtype) as engine:
        assert engine.info["cuda_graphs"] == []
        assert engine.memory_summary().graph_final_growth_bytes == 0
        eager = [run(engine, False), run(engine, True)]
    # Six requests, four running at once: batches of 4, 3, 2 and 1 all replay their own graph.
    assert graphed == eager


def test_graph_replay_is_independent_of_pages_and_slots(tiny_qwen_artifact):
    """The same prompt decoded in different slots, pages and batch neighbours gives the same tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with start(tiny_qwen_artifact, "float32", num_pages=200) as engine:
        alone = engine.generate(PROMPTS[5], sampling=sp).token_ids
        for _ in range(3):
            handles = [engine.submit(p, sampling=sp) for p in (PROMPTS[1], PROMPTS[5], PROMPTS[2])]
            results = []
            for h in handles:
                with h:
                    results.append(h.result().token_ids)
            assert results[1] == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lookahead_equals_no_lookahead_bitwise(tiny_qwen_artifact, dtype):
    """Lookahead decode (on by default with graphs) launches step n+1 into spare state slots before step
    n's tokens reach the host; greedy and seeded tokens equal those of the same engine without it."""
    def plain(engine: Engine, seeded: bool) -> list[tuple[int, ...]]:
        sp = (SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True) if seeded
              else SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        handles = submit_all(engine, sp)
        out = []
        for h in handles:
            with h:
                out.append(tuple(h.result().token_ids))
        return out

    with start(tiny_qwen_artifact, dtype) as engine:
        assert engine.info["lookahead"] is True and engine.info["cuda_graphs"] == [1, 2, 3, 4]
        # The greedy lookahead tokens come back through the graphs' pinned ring, not a copy.
        assert engine._program.graphs.ring is not None  # noqa: SLF001
        ahead = [plain(engine, False), plain(engine, True)]
        stats = engine.stats()
    with start(tiny_qwen_artifact, dtype, lookahead=False) as engine:
        assert engine.info["lookahead"] is False
        plain_runs = [plain(engine, False), plain(engine, True)]
    assert ahead == plain_runs
    assert stats.lookahead_adopted >= 2 * 20, stats.as_dict()


def test_graph_tokens_reach_the_host_through_the_ring():
    """A toy forward whose greedy token is (3 * token + position) % V: every replay's HostTokens answers its own
    replay's tokens, also when read after the ring's rows were reused several times over (kept before reuse)."""
    import torch
    from ninfer.ops.reference.greedy import greedy_tokens as reference_greedy
    from ninfer.ops.triton.greedy import greedy_tokens
    from ninfer.program.batch import DecodeRows
    from ninfer.program.graphs import RING_ROWS, DecodeGraphs

    vocab, dev = 1000, torch.device("cuda")

    def forward(tokens, positions, slots, out_slots, kv_lens, tables, slot_mapping):
        want = (3 * tokens + positions) % vocab
        return -(torch.arange(vocab, device=dev)[None, :] - want[:, None]).abs().float()

    graphs = DecodeGraphs(forward, device=dev, max_batch=2, max_pages=4, greedy=greedy_tokens)
    graphs.capture()
    assert graphs.ring is not None and graphs.ring.is_pinned()
    held = []
    for step in range(3 * RING_ROWS + 1):
        b = 1 + step % 2
        rows = DecodeRows(seqs=tuple(range(b)), device=dev, at=tuple(step + r for r in range(b)),
                          state_slots=tuple(range(b)), state_out_slots=tuple(range(b)), kv_slots=(0,) * b,
                          pages=((0,),) * b, token_ids=tuple(10 * step + r for r in range(b)))
        tokens = graphs.greedy_for(graphs.run(rows))
        host = graphs.host_tokens_for(tokens)
        assert host is not None and graphs.host_tokens_for(tokens.clone()) is None
        held.append((host, [(3 * (10 * step + r) + step + r) % vocab for r in range(b)]))
    for host, want in held:
        assert host.values() == want
    graphs.close()
    plain = DecodeGraphs(forward, device=dev, max_batch=1, max_pages=4, greedy=reference_greedy)
    assert plain.ring is None                           # the reference cannot store from inside a graph
