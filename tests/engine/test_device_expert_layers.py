"""Whole MoE layers on the device beside host experts (docs/memory.md, "Host experts"): with host experts, the last
``device_expert_layers`` MoE layers keep their experts on the device (no host step for them), and the input
embedding moves to host memory with the experts.

- the planner's automatic count: whole layers first, then cache slots on the host layers with what is left;
- the engine: explicit counts give the device-resident model's greedy tokens, and only the host layers cache;
- placement: which banks are host-placed, and the embedding with them (not when tied to the LM head or read by a
  DFlash drafter on the device);
- errors that name the option: a count that leaves no host layer, a count without host experts;
- start-up: when the decode graphs do not fit beside the layers the planner chose, one layer fewer at a time.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.engine import model_construction as mc
from ninfer.errors import NotSupportedError
from ninfer.planning import planner
from ninfer.planning.budget import MemoryPlanError

from .test_host_experts import GREEDY, PROMPTS, _fake_gpu, _generate, artifacts  # noqa: F401 (the fixture)

EXPERT = 3 * 32 * 64 * 4   # one expert of the tiny models: (gate, up, down) x I x H, fp32


def _opts(**kw) -> EngineOptions:
    return EngineOptions(device="cpu", dtype="float32", max_concurrency=1, max_context=64, num_pages=16,
                         host_experts=True, **kw)


def test_whole_layers_come_before_cache_slots(artifacts, monkeypatch, tmp_path):  # noqa: F811
    """Whole layers first, then slots on the host layers when an expert routing file is given (a plan does not
    read it); without one the slots stay empty."""
    path = artifacts["top2of8"]   # 4 MoE layers of 8 experts
    record = tmp_path / "routing.json"
    _fake_gpu(monkeypatch, 1 << 40)
    none = planner.plan(path, _opts(device_expert_layers=0, expert_cache_slots=0))
    one = planner.plan(path, _opts(device_expert_layers=1, expert_cache_slots=0))
    per_layer = one.model.profile.weight_bytes - none.model.profile.weight_bytes
    assert per_layer == 8 * EXPERT
    # Room for everything: all layers but one on the device, and that one caches every expert.
    big = planner.plan(path, _opts(expert_routing_file=str(record))).options.options
    assert (big.device_expert_layers, big.expert_cache_slots) == (3, 8)
    unknown = planner.plan(path, _opts()).options.options
    assert (unknown.device_expert_layers, unknown.expert_cache_slots) == (3, 0)
    need = max(none.memory.runtime_bytes, none.memory.startup_peak_bytes)
    # (room, whole layers, slots on each of the host layers)
    for room, layers, slots in ((per_layer + 4 * EXPERT, 1, 1), (per_layer - EXPERT, 0, 1),
                                (2 * per_layer + 2 * EXPERT, 2, 1), (3 * EXPERT, 0, 0)):
        _fake_gpu(monkeypatch, need + room)
        plan = planner.plan(path, _opts(expert_routing_file=str(record)))
        got = plan.options.options
        assert (got.device_expert_layers, got.expert_cache_slots or 0) == (layers, slots), room
        host_layers = 4 - layers
        assert plan.model.profile.weight_bytes == (none.model.profile.weight_bytes + layers * per_layer
                                                   + host_layers * slots * EXPERT)
    # A count given is kept, and the slots fill what it leaves.
    _fake_gpu(monkeypatch, need + per_layer + 4 * EXPERT)
    kept = planner.plan(path, _opts(device_expert_layers=0, expert_routing_file=str(record))).options.options
    assert (kept.device_expert_layers, kept.expert_cache_slots) == (0, 3)   # 12 experts over 4 layers


def test_explicit_device_layers_keep_the_tokens(artifacts):  # noqa: F811
    path = artifacts["top4of16"]
    plain = _generate(path, host_experts=False)
    for layers in (1, 3):
        assert _generate(path, host_experts=True, device_expert_layers=layers) == plain
    with Engine.start(path, _opts(device_expert_layers=2, expert_cache_slots=2)) as engine:
        layers = engine._program.model.layers   # noqa: SLF001
        assert [m.mlp.host is not None for m in layers] == [True, True, False, False]
        assert [m.mlp.bank_gate_up.device.type for m in layers] == ["cpu"] * 4   # the CPU: one memory
        assert engine.generate(PROMPTS[0], sampling=GREEDY).token_ids
        assert len(engine.stats().expert_cache_hits) == 2


def test_placement_of_banks_and_the_embedding(artifacts):  # noqa: F811
    from ninfer.artifact import ArtifactReader
    from ninfer.plugins import get_registry

    with ArtifactReader.open(artifacts["top2of8"]) as reader:
        text = reader.component("text")
        spec = get_registry().architecture(text.architecture)
        config = text.config

    def hosted(**kw):
        return {s.name for s in spec.parameter_specs(config, StartupFeatures(**kw)) if s.placement == "host"}

    assert hosted() == set()
    assert hosted(host_experts=True, device_expert_layers=3) == {
        "text/layers/0/moe/experts/gate_up", "text/layers/0/moe/experts/down", "text/embed"}
    assert len(hosted(host_experts=True)) == 2 * 4 + 1
    tied = {**config, "tie_word_embeddings": True}
    assert "text/embed" not in {s.name for s in spec.parameter_specs(tied, StartupFeatures(host_experts=True))
                                if s.placement == "host"}


def test_bad_counts_name_the_option(artifacts):  # noqa: F811
    with pytest.raises(NotSupportedError, match=r"device_expert_layers=4 .*4 MoE layers.*--no-host-experts"):
        planner.plan(artifacts["top2of8"], _opts(device_expert_layers=4))
    with pytest.raises(InvalidEngineOptions, match="device_expert_layers.*needs host_experts"):
        EngineOptions(host_experts=False, device_expert_layers=1).validate()
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidEngineOptions, match="device_expert_layers"):
            dataclasses.replace(EngineOptions(), device_expert_layers=bad).validate()


def test_info_memory_shows_the_expert_placement(artifacts):  # noqa: F811
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "ninfer.cli.main", "info", str(artifacts["top2of8"]), "--memory", "--device", "cpu",
            "--dtype", "float32", "--host-experts", "--device-expert-layers", "1", "--expert-cache-slots", "2"]
    text = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    assert ("routed experts    1 of 4 MoE layers whole on the device; 3 in host memory, 2 cached per layer"
            in text.stdout)
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["memory"]["routed_experts"] == {
        "moe_layers": 4, "device_expert_layers": 1, "host_expert_layers": 3, "expert_cache_slots": 2}
    plain = subprocess.run(base[:8], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "routed experts" not in plain.stdout


def test_layers_the_planner_chose_yield_when_the_graphs_do_not_fit(artifacts, monkeypatch):  # noqa: F811
    """Graph calibration measures the decode graphs only after capture; when what they take leaves too little and
    nothing automatic can shrink, the whole start runs again with one device layer fewer, down to none. A count
    the user gave is kept: its failure is the error."""
    path = artifacts["top2of8"]   # 4 MoE layers
    plain = _generate(path, host_experts=False)
    _fake_gpu(monkeypatch, 1 << 40)   # room for everything: the planner keeps 3 of the 4 layers on the device
    real = mc.start_program
    seen: list[int] = []
    failed: list[weakref.ref] = []   # each failed attempt's Program, built before its graphs "did not fit"

    def short_above(limit: int):
        def start(make_program, memory, resolved, probe, **kw):
            gc.collect()
            assert all(ref() is None for ref in failed), "a failed attempt's Program is still alive"
            seen.append(resolved.options.device_expert_layers)
            if seen[-1] > limit:
                program = make_program(memory.num_pages, None)
                failed.append(weakref.ref(program))
                raise MemoryPlanError(f"decode CUDA graphs short with {seen[-1]} device layers (test)")
            return real(make_program, memory, resolved, probe, **kw)
        return start

    monkeypatch.setattr(mc, "start_program", short_above(1))
    with Engine.start(path, dataclasses.replace(_opts(expert_cache_slots=0), max_context=256)) as engine:
        assert seen == [3, 2, 1]
        assert [m.mlp.host is not None for m in engine._program.model.layers] == [True, True, True, False]  # noqa: SLF001
        assert engine.options.device_expert_layers == 1
        assert [tuple(engine.generate(p, sampling=GREEDY).token_ids) for p in PROMPTS] == plain
    seen.clear()
    with pytest.raises(MemoryPlanError, match="short with 3 device layers"):
        Engine.start(path, _opts(device_expert_layers=3, expert_cache_slots=0))
    assert seen == [3]
    seen.clear()
    monkeypatch.setattr(mc, "start_program", short_above(-1))
    with pytest.raises(MemoryPlanError, match="short with 0 device layers"):
        Engine.start(path, _opts(expert_cache_slots=0))
    assert seen == [3, 2, 1, 0]
