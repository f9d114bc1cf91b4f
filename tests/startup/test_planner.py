"""The startup planner: budget rules, KV candidates, the one-request error, and its surfaces
(Engine.start under NINFER_VRAM_BUDGET_MIB, ``ninfer info --memory``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from ninfer.contracts.architecture import ModelProfile
from ninfer.contracts.memory import format_memory_summary
from ninfer.contracts.options import EngineOptions, InvalidEngineOptions
from ninfer.planning import budget as mb
from ninfer.planning import memory as mm
from ninfer.planning.planner import plan
from ninfer.planning.resolution import ResolvedOptions, resolve_options

MIB = 1 << 20
# 1 KiB of KV per token (16 KiB pages at page_size 16), 64 KiB of State per sequence, 100 MiB of weights.
PROFILE = ModelProfile(weight_bytes=100 * MIB, kv_bytes_per_token=1024, state_bytes_per_sequence=64 * 1024,
                       vocab_size=1000, max_position_embeddings=8192, converted_weight_bytes=10 * MIB,
                       activation_bytes_per_token=2048, attention_bytes_per_context_token=64,
                       score_bytes_per_query_key=32)
# The arithmetic tests plan without the context cache; test_the_default_context_cache_is_planned adds it.
OPTS = EngineOptions(max_concurrency=4, max_context=4096, page_size=16, prefill_chunk_size=512, context_cache=False)


def budget(mib: float, headroom_mib: float = 0) -> mb.DeviceBudget:
    return mb.DeviceBudget("cpu", int(mib * MIB), int(headroom_mib * MIB), "test")


def resolve(opts: EngineOptions = OPTS, **fields) -> ResolvedOptions:
    """``opts`` resolved for PROFILE on the CPU, with ``fields`` of the result replaced (e.g. graph_batches)."""
    resolved = resolve_options(opts, device=torch.device("cpu"), dtype=torch.float32, profile=PROFILE,
                               lookahead_supported=False)
    return dataclasses.replace(resolved, **fields)


def plan_memory(opts: EngineOptions, b: mb.DeviceBudget, *, load_bytes: int, **fields) -> mm.MemoryPlan:
    return mm.plan_memory(resolve(opts, **fields), PROFILE, b, load_bytes=load_bytes)


def test_workspace_estimate_by_hand():
    # 516 step tokens x 2048 + 4096 x 64 + min(516 x 4096 x 32, 128 MiB) + 4 rows x 1000 x 24
    got = mm.workspace_bytes(PROFILE, step_tokens=516, logit_rows=4, max_context=4096)
    assert got == 516 * 2048 + 4096 * 64 + 516 * 4096 * 32 + 4 * 1000 * 24
    # A long context hits the reference attention's score block cap ...
    capped = mm.workspace_bytes(PROFILE, step_tokens=516, logit_rows=4, max_context=1 << 20)
    assert capped == 516 * 2048 + (1 << 20) * 64 + mm.SCORE_BLOCK_BYTES + 4 * 1000 * 24
    # ... unless one query row alone exceeds it.
    one_row = (1 << 23) * 32
    huge = mm.workspace_bytes(PROFILE, step_tokens=2, logit_rows=1, max_context=1 << 23)
    assert huge == 2 * 2048 + (1 << 23) * 64 + one_row + 1000 * 24


def test_every_lane_when_the_budget_allows():
    plan = plan_memory(OPTS, budget(4096, 1024), load_bytes=50 * MIB)
    assert plan.kv_candidate == "every running request at max_context"
    assert plan.num_pages == 4 * 256 and plan.kv_bytes == 4 * 4096 * 1024
    assert plan.state_bytes == 4 * 64 * 1024 and plan.state_slots == 4
    assert max(plan.runtime_bytes, plan.startup_peak_bytes) + plan.budget.headroom_bytes <= plan.budget.budget_bytes
    assert plan.startup_peak_bytes == 50 * MIB + 10 * MIB + plan.state_bytes + plan.kv_bytes


def test_the_default_context_cache_is_planned():
    """A generation engine keeps a context cache by default: the plan holds its checkpoint StateImages
    (16 + 2 x max_concurrency) beside the running requests' and sizes the KV after them; scoring plans none."""
    default = dataclasses.replace(OPTS, context_cache=None)
    on = plan_memory(default, budget(4096, 1024), load_bytes=50 * MIB)
    off = plan_memory(OPTS, budget(4096, 1024), load_bytes=50 * MIB)
    assert on.state_bytes == (4 + 24) * 64 * 1024 and off.state_bytes == 4 * 64 * 1024
    work = mm.workspace_bytes(PROFILE, step_tokens=516, logit_rows=4, max_context=4096)
    b = budget((PROFILE.weight_bytes + 4 * 64 * 1024 + work) / MIB + 10 + 8, 10)  # 8 MiB for KV without the cache
    tight_on, tight_off = (plan_memory(o, b, load_bytes=50 * MIB) for o in (default, OPTS))
    assert tight_off.num_pages == 512 and tight_on.num_pages == 512 - 24 * 64 * 1024 // (16 * 1024)
    scoring = dataclasses.replace(OPTS, context_cache=None, purpose="causal_scoring")
    assert plan_memory(scoring, budget(4096, 1024), load_bytes=50 * MIB).state_bytes == 64 * 1024


def test_fit_to_budget_takes_the_most_pages_that_fit():
    work = mm.workspace_bytes(PROFILE, step_tokens=516, logit_rows=4, max_context=4096)
    fixed = PROFILE.weight_bytes + 4 * 64 * 1024 + work
    b = budget(fixed / MIB + 10 + 8, 10)      # 8 MiB of room: 512 pages of 16 KiB
    plan = plan_memory(OPTS, b, load_bytes=50 * MIB)
    assert plan.kv_candidate == "fit to budget" and plan.num_pages == 512
    assert plan.runtime_bytes + b.headroom_bytes <= b.budget_bytes
    # The startup peak binds when the stored weights are large: it shrinks the room the same way.
    peak_bound = plan_memory(OPTS, b, load_bytes=fixed - 10 * MIB - 4 * 64 * 1024 + 4 * MIB)
    assert peak_bound.num_pages == 256
    assert peak_bound.startup_peak_bytes + b.headroom_bytes <= b.budget_bytes


def test_one_request_must_fit_or_the_error_names_the_numbers():
    work = mm.workspace_bytes(PROFILE, step_tokens=516, logit_rows=4, max_context=4096)
    fixed = PROFILE.weight_bytes + 4 * 64 * 1024 + work
    b = budget(fixed / MIB + 3, 0)            # 3 MiB of room, one request needs 4 MiB
    with pytest.raises(mb.MemoryPlanError) as e:
        plan_memory(OPTS, b, load_bytes=0)
    msg = str(e.value)
    assert "cannot fit one request of max_context 4096" in msg and "256 KV pages x 16 tokens = 4.0 MiB" in msg
    assert "leaves 3.0 MiB for KV" in msg and "weights 100.0 MiB" in msg and "(4 running requests" in msg
    assert f"a budget of at least {mm.mib(b.budget_bytes + MIB)} holds one such request" in msg   # 1 MiB short
    # A capped CUDA budget names the cap to set: what was already in use before the plan counts against it.
    held = dataclasses.replace(b, held_bytes=500 * MIB)
    with pytest.raises(mb.MemoryPlanError, match=f"a budget of at least {mm.mib(b.budget_bytes + 501 * MIB)} holds"):
        plan_memory(OPTS, held, load_bytes=0)
    # Fewer running requests free State and workspace, and then it fits (exactly one request).
    one = plan_memory(EngineOptions(max_concurrency=1, max_context=4096, prefill_chunk_size=512, context_cache=False),
                      budget(fixed / MIB + 4), load_bytes=0)
    assert one.num_pages >= 256


def test_explicit_pages_are_checked_not_changed():
    plan = plan_memory(OPTS, budget(4096), load_bytes=0, explicit_pages=300)
    assert plan.num_pages == 300 and plan.kv_candidate == "explicit kv_budget_mib"
    with pytest.raises(mb.MemoryPlanError, match="the KV pool of 100000 pages"):
        plan_memory(OPTS, budget(1024), load_bytes=0, explicit_pages=100_000)


def test_cpu_budget_rules():
    b = mb.device_budget(torch.device("cpu"), env={})
    phys = mb.physical_memory_bytes()
    assert b.budget_bytes == int(phys * mb.CPU_BUDGET_FRACTION)
    assert b.headroom_bytes == int(b.budget_bytes * mb.CPU_HEADROOM_FRACTION)
    b = mb.device_budget(torch.device("cpu"), env={mb.BUDGET_ENV: "512"})
    assert (b.budget_bytes, b.headroom_bytes) == (512 * MIB, int(512 * MIB * 0.1))
    for bad in ("0", "-3", "lots"):
        with pytest.raises(InvalidEngineOptions, match=mb.BUDGET_ENV):
            mb.device_budget(torch.device("cpu"), env={mb.BUDGET_ENV: bad})


def test_cuda_budget_is_free_memory_capped_by_the_env(monkeypatch):
    # 512 MiB of the device is in use before the plan (the CUDA context): the cap counts it.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: ((140 << 30) - 512 * MIB, 140 << 30))
    b = mb.device_budget(torch.device("cuda"), env={})
    assert (b.budget_bytes, b.headroom_bytes, b.held_bytes) == ((140 << 30) - 512 * MIB, 1 << 30, 0)
    b = mb.device_budget(torch.device("cuda"), env={mb.BUDGET_ENV: "4096"})
    assert (b.budget_bytes, b.headroom_bytes, b.held_bytes) == (3584 * MIB, 1 << 30, 512 * MIB)
    assert "less 512.0 MiB already in use" in b.source and "CUDA context" in b.source
    b = mb.device_budget(torch.device("cuda"), env={mb.BUDGET_ENV: "400"})
    assert b.budget_bytes == 0                 # a cap below what is in use leaves nothing (the plan then fails)
    # Real free memory is the other cap (other processes hold 60 GiB).
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 140 << 30))
    b = mb.device_budget(torch.device("cuda"), env={mb.BUDGET_ENV: str(200 * 1024)})
    assert (b.budget_bytes, b.held_bytes) == (80 << 30, 0)


def test_the_cuda_headroom_can_be_set_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: ((140 << 30) - 512 * MIB, 140 << 30))
    b = mb.device_budget(torch.device("cuda"), env={mb.BUDGET_ENV: "4096", mb.HEADROOM_ENV: "256"})
    assert (b.budget_bytes, b.headroom_bytes) == (3584 * MIB, 256 * MIB)
    assert mb.device_budget(torch.device("cuda"), env={mb.HEADROOM_ENV: "0"}).headroom_bytes == 0
    assert mb.device_budget(torch.device("cuda"), env={mb.HEADROOM_ENV: " "}).headroom_bytes == 1 << 30
    for bad in ("-1", "lots", "nan"):
        with pytest.raises(InvalidEngineOptions, match="NINFER_VRAM_HEADROOM_MIB"):
            mb.device_budget(torch.device("cuda"), env={mb.HEADROOM_ENV: bad})
    # The CPU keeps its proportionate headroom: the variable is about the GPU's driver-side allocations.
    cpu = mb.device_budget(torch.device("cpu"), env={mb.BUDGET_ENV: "512", mb.HEADROOM_ENV: "0"})
    assert cpu.headroom_bytes == int(512 * MIB * mb.CPU_HEADROOM_FRACTION)


def test_engine_start_shrinks_kv_under_a_budget_and_refuses_below_one_request(default_artifact, monkeypatch):
    from ninfer import Engine

    planned = plan(default_artifact, EngineOptions(device="cpu", max_concurrency=4, max_context=1024)).summary()
    assert planned.kv_candidate == "every running request at max_context" and planned.num_pages == 4 * 64
    # A budget with room for ~2.5 requests: the pool shrinks to what fits, never below one request.
    fixed = max(planned.weights_bytes + planned.state_bytes + planned.workspace_bytes,
                planned.startup_peak_bytes - planned.kv_bytes)
    room = planned.kv_bytes * 5 // 8
    mib = (fixed + room) / 0.9 / MIB + 0.01
    monkeypatch.setenv(mb.BUDGET_ENV, f"{mib:.3f}")
    with Engine.start(default_artifact, device="cpu", max_concurrency=4, max_context=1024) as engine:
        m = engine.memory_summary()
        assert m.kv_candidate == "fit to budget" and 64 <= m.num_pages < 4 * 64
        assert m.planned_bytes + m.headroom_bytes <= m.budget_bytes
        assert engine.stats().pages_total == m.num_pages
        out = engine.generate(list(range(10, 30)), sampling=engine.sampling_params(temperature=0.0, max_tokens=4))
        assert out.usage.completion_tokens == 4
    monkeypatch.setenv(mb.BUDGET_ENV, "40")
    with pytest.raises(mb.MemoryPlanError, match="cannot fit one request of max_context 1024"):
        Engine.start(default_artifact, device="cpu", max_concurrency=4, max_context=1024)


def test_info_memory_prints_the_plan_without_loading(default_artifact, capsys, monkeypatch):
    from ninfer.cli.main import main

    monkeypatch.delenv(mb.BUDGET_ENV, raising=False)
    assert main(["info", str(default_artifact), "--memory", "--device", "cpu", "--max-concurrency", "2",
                 "--max-context", "512"]) == 0
    out = capsys.readouterr().out
    assert "memory (cpu, float32; planned, no weights loaded):" in out
    assert "KV                " in out and "64 pages x 16 tokens = 1,024 tokens; every running request at max_context" in out
    assert main(["info", str(default_artifact), "--memory", "--json", "--dtype", "bfloat16", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    mem = data["memory"]
    assert mem["dtype"] == "bfloat16" and mem["measured"] is False
    assert mem["kv_state_bytes"] == mem["kv_bytes"] + mem["state_bytes"]
    monkeypatch.setenv(mb.BUDGET_ENV, "1")
    assert main(["info", str(default_artifact), "--memory", "--device", "cpu"]) == 2
    assert "cannot fit one request" in capsys.readouterr().err


def test_format_memory_summary_names_every_part():
    plan = plan_memory(OPTS, budget(4096, 1024), load_bytes=50 * MIB)
    text = format_memory_summary(plan.summary(torch.bfloat16))
    for label in ("budget", "weights", "KV", "State", "workspace", "graphs", "headroom", "startup peak",
                  "startup retained", "runtime reserved", "max_context"):
        assert f"\n  {label} " in text
    assert "planned, no weights loaded" in text and "(no CUDA graphs)" in text


def test_decode_graphs_are_planned_before_the_kv_capacity():
    """With graphs for B = 1..4 the plan reserves their pool estimate (the decode step of 4 rows) and the
    "fit to budget" KV shrinks by exactly that many pages' worth; the summary carries the estimate."""
    est = mm.graph_pool_bytes(PROFILE, 4, 4096)
    assert est == mm.workspace_bytes(PROFILE, step_tokens=4, logit_rows=4, max_context=4096) > 0
    assert mm.graph_pool_bytes(PROFILE, 0, 4096) == 0
    work = mm.workspace_bytes(PROFILE, step_tokens=516, logit_rows=4, max_context=4096)
    b = budget((PROFILE.weight_bytes + 4 * 64 * 1024 + work) / MIB + 10 + 8, 10)  # 8 MiB of room for KV
    without = plan_memory(OPTS, b, load_bytes=0)
    with_graphs = plan_memory(OPTS, b, load_bytes=0, graph_batches=4)
    page_bytes = OPTS.page_size * PROFILE.kv_bytes_per_token
    assert without.kv_candidate == with_graphs.kv_candidate == "fit to budget"
    assert without.num_pages - with_graphs.num_pages in (est // page_bytes, -(-est // page_bytes))
    assert with_graphs.runtime_bytes + b.headroom_bytes <= b.budget_bytes
    summary = with_graphs.summary("bfloat16")
    assert summary.graph_rebuild_estimate_bytes == est and summary.graph_final_growth_bytes == 0
    assert summary.planned_bytes == with_graphs.runtime_bytes
    assert "(estimate, decode graphs planned)" in format_memory_summary(summary)


def test_lookahead_spares_are_planned_like_the_engine_builds_them(default_artifact):
    """Lookahead decode holds max_concurrency spare StateImages: the plan counts them (``ninfer info
    --memory`` and the engine alike), capacity() does not, and forcing it on for the CPU builds them."""
    from ninfer import Engine

    def opts(**kw):
        return EngineOptions(device="cpu", max_concurrency=3, context_cache=False, **kw)

    off = plan(default_artifact, opts(lookahead=False)).summary()
    on = plan(default_artifact, opts(lookahead=True)).summary()
    auto = plan(default_artifact, opts()).summary()
    assert auto.state_bytes == off.state_bytes  # auto: only with CUDA graphs
    assert on.state_bytes == off.state_bytes * 2  # 3 sequences + 3 spares, no checkpoints
    with Engine.start(default_artifact, opts(lookahead=True)) as engine:
        assert engine.memory_summary().state_bytes == on.state_bytes
        program = engine._program
        assert program.states.num_slots == 6 and program.capacity().total_state_slots == 3


def test_info_memory_options_without_memory_are_an_error(default_artifact, capsys):
    """The plan options do nothing without --memory: named, not silently ignored (which looked like a plan)."""
    from ninfer.cli.main import main

    assert main(["info", str(default_artifact), "--num-pages", "3", "--kv-budget-mib", "1"]) == 2
    assert "--num-pages, --kv-budget-mib: memory plan options, which need --memory" in capsys.readouterr().err


def test_speculation_adds_snapshots_workspace_and_the_mtp_layer():
    """The plan of k drafts: (k + 1) snapshot StateImages per running request and a k + 1 token decode row
    each in the workspace; the profile of a speculative start adds the MTP weights and KV pool."""
    plain = plan_memory(OPTS, budget(4096, 1024), load_bytes=50 * MIB)
    spec = plan_memory(OPTS, budget(4096, 1024), load_bytes=50 * MIB, speculative_tokens=3)
    assert spec.state_bytes - plain.state_bytes == 4 * (3 + 1) * 64 * 1024
    step = min(512, 4 * 512)
    assert spec.workspace_bytes - plain.workspace_bytes == (
        mm.workspace_bytes(PROFILE, step_tokens=step + 4 * 4, logit_rows=4 * 4, max_context=4096)
        - mm.workspace_bytes(PROFILE, step_tokens=step + 4, logit_rows=4, max_context=4096))


def test_a_speculative_profile_counts_the_mtp_head(default_artifact):
    from ninfer.planning.planner import artifact_profile

    base = EngineOptions(device="cpu", dtype="float32", max_concurrency=2, max_context=256, context_cache=False)
    plain = artifact_profile(default_artifact, base)
    spec = artifact_profile(default_artifact, dataclasses.replace(base, speculative="mtp"))
    mtp = [s for s in spec.parameter_specs if s.component == "mtp"]
    assert mtp and {s.name for s in spec.parameter_specs} - {s.name for s in plain.parameter_specs} == {
        s.name for s in mtp}
    mtp_bytes = sum(torch.Size(s.shape).numel() * 4 for s in mtp)
    assert spec.profile.weight_bytes - plain.profile.weight_bytes == mtp_bytes
    layers = plain.config["layer_types"].count("full_attention")   # the MTP layer's pool is one more
    assert layers and spec.profile.kv_bytes_per_token * layers == plain.profile.kv_bytes_per_token * (layers + 1)
    assert spec.profile.state_bytes_per_sequence == plain.profile.state_bytes_per_sequence
    assert spec.options.speculative_tokens == 3 and spec.options.program_options(8).speculative_tokens == 3


def test_a_budget_too_small_for_the_default_chunk_plans_a_smaller_one(default_artifact, monkeypatch):
    """``prefill_chunk_size`` left to the planner: when the default chunk's step workspace does not fit, the first
    smaller chunk that fits is planned (an explicit chunk is never changed); below every chunk the error says so."""
    opts = EngineOptions(device="cpu", max_concurrency=1, max_context=4096)

    def least_mib(chunk: int) -> float:   # the smallest budget (MiB, 1/16 steps) a plan with this chunk fits
        lo, hi = 1.0, 4096.0
        while hi - lo > 1 / 16:
            mid = (lo + hi) / 2
            monkeypatch.setenv(mb.BUDGET_ENV, f"{mid:.4f}")
            try:
                plan(default_artifact, dataclasses.replace(opts, prefill_chunk_size=chunk))
                hi = mid
            except mb.MemoryPlanError:
                lo = mid
        return hi

    default, smallest = least_mib(opts.max_context), least_mib(512)
    assert smallest < default   # the workspace grows with the chunk
    monkeypatch.setenv(mb.BUDGET_ENV, f"{(smallest + default) / 2:.4f}")
    fitted = plan(default_artifact, opts)
    assert fitted.options.options.prefill_chunk_size in (512, 1024, 2048)
    with pytest.raises(mb.MemoryPlanError):
        plan(default_artifact, dataclasses.replace(opts, prefill_chunk_size=4096))
    monkeypatch.setenv(mb.BUDGET_ENV, f"{smallest - 0.5:.4f}")
    with pytest.raises(mb.MemoryPlanError, match="also with prefill chunks down to 512 tokens"):
        plan(default_artifact, opts)


def test_prefill_graphs_add_their_padding_slot_and_their_pool():
    plain = plan_memory(OPTS, budget(4096), load_bytes=0)
    graphed = plan_memory(OPTS, budget(4096), load_bytes=0, prefill_graph_tokens=(16, 32, 64))
    assert graphed.state_bytes == plain.state_bytes + PROFILE.state_bytes_per_sequence
    # The largest bucket's step (64 tokens), its 4 rows and the padding row sampling.
    pool = mm.workspace_bytes(PROFILE, step_tokens=64, logit_rows=5, max_context=4096)
    assert graphed.graph_bytes == plain.graph_bytes + pool
