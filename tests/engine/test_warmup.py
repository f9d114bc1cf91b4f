"""Start-up warm-up (issue 30 item 3; ``ninfer.program.warmup``), on the CPU with the option forced on.

- It runs the plan's shapes through the Program contract: every chunk count and decode batch up to
  max_concurrency, decode rows beside chunks, chunks that do not sample, constrained, penalised, sampled and
  logprob rows, lookahead adoption, a checkpoint.
- It leaves nothing behind: no sequence, page, slot, checkpoint or lookahead; the Program's counters and the
  engine's stats read as on a fresh engine.
- It changes no result: a burst with several prefills per step gives the same tokens and logprobs with and
  without it (greedy and seeded sampling, penalties).
"""

from __future__ import annotations

import dataclasses

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.contracts.program import ProgramError, WarmupLimits
from ninfer.contracts.sampling import SamplingParams
from ninfer.program.warmup import ODD_TOKENS, SMALL_TOKENS, prefill_sizes

from .doubles import ToyProgram
from .test_multi_prefill import burst, qwen_work


def qwen_engine(artifact, **options) -> Engine:
    options = {"device": "cpu", "max_context": 128, "page_size": 4, **options}
    return Engine.start(artifact, EngineOptions(**options))


def assert_nothing_held(engine: Engine) -> None:
    program = engine._program  # noqa: SLF001
    cap = program.capacity()
    assert (cap.free_pages, cap.free_state_slots) == (cap.total_pages, cap.total_state_slots)
    assert program._seqs == {} and program._lookahead is None  # noqa: SLF001
    assert len(program._spares) == program.lookahead_slots  # noqa: SLF001
    assert program.checkpoint_usage().count == 0
    la = program.lookahead_stats
    assert (la.launched, la.adopted, la.dropped) == (0, 0, 0)
    s = engine.stats()
    assert (s.pages_used, s.state_slots_used, s.cache_checkpoints, s.units, s.admitted, s.prefill_tokens,
            s.decode_tokens, s.lookahead_launched, s.lookahead_dropped) == (0,) * 9


def test_warmup_runs_and_leaves_nothing_behind(tiny_qwen_artifact):
    with qwen_engine(tiny_qwen_artifact, max_concurrency=4, prefill_chunk_size=32, max_step_tokens=8,
                     lookahead=True, warmup=True) as engine:
        startup = engine.info["startup"]
        assert startup["warmup_units"] > 0 and startup["warmup_skipped"] == 0
        assert startup["warmup_s"] <= startup["total_s"]
        assert_nothing_held(engine)


def test_warmup_off_by_default_on_the_cpu(tiny_qwen_artifact):
    with qwen_engine(tiny_qwen_artifact, max_concurrency=2) as engine:
        assert "warmup_s" not in engine.info["startup"]
        assert {"resolve_s", "load_s", "graphs_s", "total_s"} <= set(engine.info["startup"])


@pytest.fixture(scope="module")
def burst_work():
    work = qwen_work([30, 3, 17, 9, 41, 2, 12, 25], seed=11)
    # Logprobs and penalties on some rows (greedy and seeded sampling come from qwen_work).
    work[2] = (work[2][0], dataclasses.replace(work[2][1], logprobs=True, top_logprobs=2))
    work[5] = (work[5][0], dataclasses.replace(work[5][1], repetition_penalty=1.3, frequency_penalty=0.4))
    return work


def run_burst(artifact, work, warmup: bool):
    with qwen_engine(artifact, max_concurrency=8, prefill_chunk_size=16, max_step_tokens=12, lookahead=True,
                     warmup=warmup) as engine:
        program = engine._program  # noqa: SLF001
        handles_tokens = burst(engine, program, work)
        stats = engine.stats()
        assert stats.max_unit_chunks >= 2   # several prefills per step
        logprobs = []
        for p, sp in work[:3]:
            with engine.submit(p, sampling=sp) as handle:
                logprobs.append([e.logprobs for e in handle if isinstance(e, GenerationDelta)])
        assert any(lp is not None for deltas in logprobs for lp in deltas)
        return handles_tokens, logprobs


def test_outputs_after_warmup_equal_outputs_without(tiny_qwen_artifact, burst_work):
    assert run_burst(tiny_qwen_artifact, burst_work, True) == run_burst(tiny_qwen_artifact, burst_work, False)


def test_warmup_with_a_context_cache_and_one_row(tiny_qwen_artifact):
    with qwen_engine(tiny_qwen_artifact, max_concurrency=1, prefill_chunk_size=8, warmup=True) as engine:
        assert engine.info["startup"]["warmup_units"] > 0
        assert_nothing_held(engine)
        assert engine.generate([5, 6, 7], max_tokens=3, temperature=0).token_ids


def record_units(program) -> list:
    """(decode rows as (kind, drafts), chunks as (tokens, samples)) of every unit ``program.run`` gets."""
    log = []
    run = program.run

    def recording(unit):
        log.append(([(("masked" if r.sampling.mask is not None else ""), r.sampling.params, r.drafts)
                     for r in unit.decode],
                    [(c.num_tokens, c.sampling is not None) for c in unit.chunks]))
        return run(unit)

    program.run = recording
    return log


def test_plan_covers_the_shape_classes():
    program = ToyProgram(max_sequences=4, max_context=256)
    log = record_units(program)
    summary = program.warm_up(WarmupLimits(max_rows=4, prefill_chunk=64, step_tokens=8))
    assert summary.units == len(log) and summary.skipped == 0
    prefill_only = [chunks for dec, chunks in log if not dec]
    single = {c[0][0] for c in prefill_only if len(c) == 1 and c[0][1]}
    assert set(prefill_sizes(64)) <= single
    assert {len(c) for c in prefill_only} == {1, 2, 3, 4}                  # every chunk count
    assert any(not any(s for _, s in c) for c in prefill_only)            # a unit with no sampling row
    decode_only = [dec for dec, chunks in log if not chunks]
    assert {len(d) for d in decode_only} == {1, 2, 3, 4}                  # every decode batch
    mixed = [(dec, chunks) for dec, chunks in log if dec and chunks]
    assert {len(dec) for dec, _ in mixed} == {1, 2, 3}
    assert all(len(dec) + sum(n for n, _ in chunks) <= 8 for dec, chunks in mixed)   # the step budget
    rows = [r for dec, _ in log for r in dec]
    assert any(m for m, _, _ in rows)                                      # constrained rows
    params = [p for _, p, _ in rows]
    assert any(p.temperature > 0 for p in params) and any(p.temperature == 0 for p in params)
    assert any(p.logprobs for p in params) and any(p.repetition_penalty != 1.0 for p in params)
    assert all(d == 0 for _, _, d in rows)                                 # no speculation asked
    assert program._seqs == {} and program.capacity().free_pages == program.capacity().total_pages  # noqa: SLF001


def test_warmup_on_the_toy_engine_changes_no_token(make_toy_engine):
    work = [([3 + i, 9, 4 + 2 * i][: 1 + i % 3] * (1 + i), SamplingParams(temperature=0.0 if i % 2 else 0.8,
                                                                         seed=i, max_tokens=6))
            for i in range(6)]
    outs = []
    for warmup in (True, False):
        engine, program, _ = make_toy_engine(max_concurrency=4, prefill_chunk_size=8, warmup=warmup)
        assert bool(program.units) == warmup and engine.stats().units == 0
        outs.append([engine.generate(p, sampling=sp).token_ids for p, sp in work])
    assert outs[0] == outs[1]


def test_warmup_needs_an_empty_program():
    program = ToyProgram()
    program.open_sequence([1, 2, 3])
    with pytest.raises(ProgramError, match="empty Program"):
        program.warm_up(WarmupLimits(max_rows=2, prefill_chunk=8, step_tokens=8))


@pytest.mark.parametrize("field, value", [("max_rows", 0), ("prefill_chunk", True), ("step_tokens", 1.5),
                                          ("speculative_tokens", -1)])
def test_warmup_limits_are_checked(field, value):
    kw = dict(max_rows=2, prefill_chunk=8, step_tokens=8) | {field: value}
    with pytest.raises(ProgramError, match=f"WarmupLimits.{field}"):
        WarmupLimits(**kw)


def test_prefill_sizes():
    sizes = prefill_sizes(300)
    assert sizes == sorted(set(sizes)) and max(sizes) == 300
    assert set(range(1, SMALL_TOKENS + 1)) | {32, 64, 128, 256} | set(ODD_TOKENS) <= set(sizes)
    assert prefill_sizes(5) == [1, 2, 3, 4, 5]


def test_warmup_option_rules():
    import torch
    from ninfer.planning.resolution import warmup_enabled

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert warmup_enabled(cuda, EngineOptions()) and not warmup_enabled(cpu, EngineOptions())
    assert warmup_enabled(cpu, EngineOptions(warmup=True)) and not warmup_enabled(cuda, EngineOptions(warmup=False))
    assert not warmup_enabled(cuda, EngineOptions(purpose="causal_scoring"))
    with pytest.raises(InvalidEngineOptions, match="warmup"):
        EngineOptions(purpose="causal_scoring", warmup=True).validate()


def test_toy_engine_from_parts_reports_its_warmup(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=2, warmup=True)
    assert engine.info["startup"]["warmup_units"] > 0
    assert program._seqs == {}  # noqa: SLF001
    assert engine.generate([4, 5, 6], max_tokens=3).token_ids


def test_speculative_warmup_runs_verify_rows_and_changes_no_token(default_artifact, monkeypatch):
    from ninfer.program import warmup

    drafts: list[int] = []
    run = warmup._Runner.run  # noqa: SLF001

    def recording(self, decode=(), chunks=()):
        drafts.extend(d for _, _, d in decode)
        return run(self, decode, chunks)

    monkeypatch.setattr(warmup._Runner, "run", recording)  # noqa: SLF001
    prompts = ["import os\nimport sys\n", "def main():\n", "class Queue:\n    def __init__(self):\n"]
    sampling = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=12)]
    outs = []
    for on in (True, False):
        options = EngineOptions(device="cpu", dtype="float32", max_context=160, page_size=4, max_concurrency=3,
                                prefill_chunk_size=32, speculative="mtp", num_speculative_tokens=2, warmup=on)
        with Engine.start(default_artifact, options) as engine:
            if on:
                assert 2 in drafts                       # verify rows of k = 2 drafts ran
                m = engine._program.speculation  # noqa: SLF001
                assert (m.verified, m.drafted, m.accepted) == (0, 0, 0)
                assert_nothing_held(engine)
            handles = [engine.submit(p, sampling=sp) for p in prompts for sp in sampling]
            outs.append([h.result(120).token_ids for h in handles])
    assert outs[0] == outs[1]


def test_warmup_runs_its_units_with_the_prefill_graphs_set_aside(tiny_qwen_artifact, monkeypatch):
    """A step the graphs hold may still run eagerly while serving (a verify or scoring chunk, a lookahead's rows), so
    the warm-up's units run eagerly and compile those variants; the graphs come back afterwards, also when a unit
    fails."""
    import ninfer.program.warmup as warmup

    with qwen_engine(tiny_qwen_artifact, max_concurrency=2) as engine:
        program = engine._program  # noqa: SLF001
        graphs = object()
        program.prefill_graphs = graphs
        seen = []

        def record(prog, limits):
            seen.append(prog.prefill_graphs)
            raise RuntimeError("a unit failed")

        monkeypatch.setattr(warmup, "run_warm_up", record)
        with pytest.raises(RuntimeError, match="a unit failed"):
            program.warm_up(WarmupLimits(max_rows=2, prefill_chunk=16, step_tokens=8, speculative_tokens=0))
        assert seen == [None] and program.prefill_graphs is graphs
        program.prefill_graphs = None
