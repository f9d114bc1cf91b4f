"""The Qwen4-Exp ModelProfile against the Program's real allocations (device weights, converted bytes, KV with the
indexer's side pools, StateImage with the PLE fields, and the host-resident n-gram tables), and the planner's
accounting of those tables as host memory."""

from __future__ import annotations

import pytest
import torch
from ninfer import EngineOptions
from ninfer.contracts.memory import format_memory_summary
from ninfer.planning.budget import MemoryPlanError
from ninfer.planning.planner import plan
from ninfer.testing import build_program, profile_mismatches

from .harness import CASES


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_profile_is_exact(q4x_case, name, dtype):
    built = build_program(q4x_case(name).artifact, dtype=dtype)
    assert profile_mismatches(built) == []
    tables = sum(w.numel() * w.element_size() for n, w in built.weights.items() if n.endswith("ple/table"))
    assert built.profile.host_weight_bytes == tables
    assert (tables > 0) == (name != "plain")


def test_the_planner_counts_the_tables_as_host_memory(q4x_case):
    artifact = q4x_case("dense").artifact
    options = EngineOptions(device="cpu", dtype="float32", max_context=64, page_size=4, max_concurrency=1)
    cpu = plan(artifact, options, env={})
    host = cpu.model.profile.host_weight_bytes
    assert host > 0 and cpu.model.source.host_load_bytes == host
    # On the CPU, host memory is the device's: the tables are in the weights and the startup peak.
    assert cpu.memory.weights_bytes == cpu.model.profile.weight_bytes + host
    assert cpu.memory.host_weights_bytes == host and cpu.memory.host_budget_bytes == 0
    assert "host weights" in format_memory_summary(cpu.summary())
    # A budget that holds everything but the tables fails, naming them.
    need = cpu.memory.runtime_bytes - host
    with pytest.raises(MemoryPlanError, match="cannot fit one request"):
        plan(artifact, options, env={"NINFER_VRAM_BUDGET_MIB": str((need + host // 2) / 2**20 / 0.9)})


def test_a_device_run_checks_the_host_budget(q4x_case):
    """On a device other than the CPU the tables do not count against the device budget but must fit the host's."""
    from ninfer.planning.budget import DeviceBudget
    from ninfer.planning.memory import plan_memory
    from ninfer.planning.planner import artifact_profile

    model = artifact_profile(q4x_case("dense").artifact,
                             EngineOptions(device="cpu", dtype="float32", max_context=64, page_size=4,
                                           max_concurrency=1))
    host = model.profile.host_weight_bytes
    device = DeviceBudget("cuda:0", 1 << 30, 0, "test")
    ok = plan_memory(model.options, model.profile, device, load_bytes=model.source.load_bytes,
                     host_load_bytes=host, host_budget=DeviceBudget("host", host + 100, 0, "test"))
    assert ok.weights_bytes == model.profile.weight_bytes and ok.host_weights_bytes == host
    assert ok.host_budget_bytes == host + 100
    with pytest.raises(MemoryPlanError, match="weights placed in host memory"):
        plan_memory(model.options, model.profile, device, load_bytes=model.source.load_bytes, host_load_bytes=host,
                    host_budget=DeviceBudget("host", host - 1, 0, "test"))
