"""Bus reads of host experts (ninfer_qwen3_5.layers.expert_costs module docstring): the device computes the last
choices of each token of a decode step reading the experts in place in host memory, while the host computes the
others.

- the split the cost model picks, from the measured bus and host seconds and the host's measured scale;
- the layer's sum with bus reads against an fp64 oracle, in fp32 and bf16, one token and several, all choices on
  the bus and none; the calls that must not use them (a cache, quantized banks, a large call, no bus measure);
- the engine's greedy tokens with bus reads equal those with every expert on the device (on the CPU, where host
  and device are one memory but the code path is the same).
"""

from __future__ import annotations

import types

import pytest
import torch
from ninfer.ops.reference.moe import moe_experts
from ninfer_qwen3_5.layers import host_experts as he
from ninfer_qwen3_5.layers import host_options
from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
from ninfer_qwen3_5.layers.host_experts import BUS_PAIRS, ExpertStage, HostExperts

from .test_host_experts import _case, _fp64_moe, _generate, artifacts  # noqa: F401 (the fixture)

CPU = torch.device("cpu")


def test_the_split_balances_the_bus_against_the_host():
    even = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=1.0)
    assert even.bus_ranks(8) == 4
    assert even.bus_ranks(1) == 0   # one choice: max(1, 0) ties max(0, 1), the fewer on the bus
    slow_bus = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=3.0)
    assert slow_bus.bus_ranks(8) == 2   # max(3 * 2, 6) = 6 beats d = 1 (7) and d = 3 (9)
    slow_host = ExpertCosts(copy_s=1.0, host_s=3.0, host_token_s=0.5, bus_s=1.0)
    assert slow_host.bus_ranks(8) == 6   # a host three times slower gives up more
    fast_bus = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=0.01)
    assert fast_bus.bus_ranks(8) == 8
    assert ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=100.0).bus_ranks(8) == 0
    assert ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5).bus_ranks(8) == 0   # not measured
    with pytest.raises(ValueError, match="must be > 0"):
        ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=0.0)


def _layer(gate_up, down, dtype, bus_s=1.0, **extra):
    costs = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=bus_s)
    return HostExperts(gate_up, down, ops=types.SimpleNamespace(moe_experts=moe_experts), device=CPU, dtype=dtype,
                       costs=costs, stage=ExpertStage(CPU, dtype, slots=2), **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,bus_s", [(1, 1.0), (3, 1.0), (1, 0.01), (2, 3.0)])
def test_the_layer_with_bus_reads_against_fp64(dtype, tokens, bus_s):
    x, w, ids, gate_up, down, shared = _case(dtype, experts=16, k=4, tokens=tokens)
    shared_f = type(shared)(shared.projected.float(), shared.down.float(), shared.gate_logit)
    want = _fp64_moe(x.float(), w, ids, gate_up.float(), down.float(), shared_f)
    layer = _layer(gate_up, down, dtype, bus_s)
    ranks = layer.costs.bus_ranks(4)
    assert ranks > 0
    got = layer(x, w, ids, shared)
    assert layer.bus_pairs == tokens * ranks and layer.copied_experts == 0
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < (2e-6 if dtype == torch.float32 else 1.5e-2), err


def test_the_bus_share_and_the_host_share_are_the_right_choices(monkeypatch):
    # The host computes the first choices and skips the last ones: a host share that left out the wrong pairs (or
    # none) would count some pairs twice or never, which the oracle comparison above catches only in sum.
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=16, k=4, tokens=2)
    seen = {}
    real = he.routed_sum

    def spy(x_h, w_h, ids_h, *args, skip=None, **kwargs):
        seen["skip"] = skip.clone()
        return real(x_h, w_h, ids_h, *args, skip=skip, **kwargs)

    monkeypatch.setattr(he, "routed_sum", spy)
    layer = _layer(gate_up, down, torch.float32)   # even costs: 2 of 4 on the bus
    layer(x, w, ids, shared)
    assert seen["skip"].tolist() == [[False, False, True, True]] * 2


def test_the_split_is_fixed_at_the_first_call():
    # The device's kernels are compiled for one count in the warm-up: costs that change later do not move it.
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=16, k=4, tokens=1)
    layer = _layer(gate_up, down, torch.float32, bus_s=3.0)   # max(3d, 4 - d): d = 1
    layer(x, w, ids, shared)
    layer.costs = ExpertCosts(copy_s=1.0, host_s=10.0, host_token_s=0.5, bus_s=3.0)   # would give d = 3
    layer(x, w, ids, shared)
    assert layer.bus_pairs == 2 and layer.costs.bus_ranks(4) == 3


def test_calls_that_do_not_read_over_the_bus():
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=16, k=4, tokens=3)
    cached = _layer(gate_up, down, torch.float32, cache_slots=4)
    cached(x, w, ids, shared)
    assert cached.bus_pairs == 0   # a cache keeps its own device pairs
    assert not _layer(gate_up.to(torch.bfloat16), down.to(torch.bfloat16), torch.float32)._bus  # noqa: SLF001
    # (stored bf16 in an fp32 run: the device's op would convert the whole bank)
    assert not _layer(gate_up.transpose(1, 2).contiguous().transpose(1, 2), down, torch.float32)._bus  # noqa: SLF001
    unmeasured = _layer(gate_up, down, torch.float32, bus_s=None)
    unmeasured(x, w, ids, shared)
    assert unmeasured.bus_pairs == 0
    from ninfer.quant.packed import packed_view
    from ops_triton.quant_cases import parent_bytes

    def pack(bank):   # q8, as an artifact stores it
        parent = parent_bytes("q8_g32_fp16", bank.reshape(-1, bank.shape[-1]))
        return packed_view("q8_g32_fp16", parent, tuple(bank.shape), 0, bank.numel(), tuple(bank.shape))

    assert not _layer(pack(gate_up), pack(down), torch.float32)._bus   # noqa: SLF001 (dense banks only)
    bx, bw, bids, bgate_up, bdown, bshared = _case(torch.float32, experts=16, k=4, tokens=BUS_PAIRS // 4 + 1)
    layer = _layer(bgate_up, bdown, torch.float32)
    layer(bx, bw, bids, bshared)
    assert layer.bus_pairs == 0   # a prefill chunk's call: the GEMVs would read an expert once a pair


def test_the_engine_with_bus_reads_keeps_the_tokens(artifacts, monkeypatch):  # noqa: F811 (the fixture)
    # On the CPU no bus is measured: the start-up's costs are replaced by ones that send half of each decode
    # step's choices to the device's op, which on the CPU reads the same memory through the same code path.
    calls = []
    real = HostExperts._bus_call

    def counted(self, *args):
        calls.append(args[-1])
        return real(self, *args)

    monkeypatch.setattr(host_options, "measure_expert_costs",
                        lambda *a, **k: ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=1.0))
    monkeypatch.setattr(HostExperts, "_bus_call", counted)
    plain = _generate(artifacts["top2of8"], host_experts=False)
    assert not calls
    assert _generate(artifacts["top2of8"], host_experts=True) == plain
    assert calls and set(calls) == {1}   # top-2: one choice of each token on the bus


def test_a_bus_that_fails_to_read_leaves_the_copies(caplog):
    # measure_expert_costs on a device whose op cannot read host memory in place: a warning, no bus_s. Driven on the
    # CPU past its early return (a stand-in "cuda" device whose timing runs on the CPU): the bus timing itself runs
    # as on a GPU, and the op it times raises as Triton does for a pointer it cannot read.
    from ninfer_qwen3_5.layers import expert_costs

    def refuses(*args, **kwargs):
        raise ValueError("Pointer argument (at 1) cannot be accessed from Triton (cpu tensor?)")

    real = expert_costs._bus_seconds  # noqa: SLF001
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(expert_costs, "host_to_device_bandwidth", lambda device: 1e9)
        mp.setattr(expert_costs, "HOST_PROBE_BYTES", 1 << 20)
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)   # the timing's sync for a "cuda" device
        mp.setattr(expert_costs, "probe_bank", lambda e, r, k, dtype, fmt: torch.zeros((e, r, k), dtype=dtype))
        mp.setattr(expert_costs, "_bus_seconds", lambda bus, gu, dn, device, dtype: real(bus, gu, dn, CPU, dtype))
        with caplog.at_level("WARNING", logger="ninfer_qwen3_5.layers.expert_costs"):
            costs = expert_costs.measure_expert_costs(64, 32, types.SimpleNamespace(type="cuda"), torch.float32,
                                                      bus=refuses)
            fine = expert_costs.measure_expert_costs(64, 32, types.SimpleNamespace(type="cuda"), torch.float32,
                                                     bus=moe_experts)
    assert costs is not None and costs.bus_s is None and costs.host_s > 0
    assert "could not read experts in host memory" in caplog.text and "Pointer argument" in caplog.text
    assert fine.bus_s > 0   # the same timing with an op that reads them


def test_bus_reads_are_on_by_default(monkeypatch):
    from ninfer.contracts.features import StartupFeatures
    from ninfer.contracts.options import InvalidEngineOptions
    from ninfer_qwen3_5.layers.host_options import BUS_READS_ENV, host_expert_options

    asked = []
    monkeypatch.setattr(host_options, "measure_expert_costs", lambda *a, **k: asked.append(k["bus"]))
    ops = types.SimpleNamespace(moe_experts=moe_experts)
    features = StartupFeatures(host_experts=True)
    monkeypatch.delenv(BUS_READS_ENV, raising=False)
    host_expert_options(64, 32, 8, CPU, torch.float32, features, ops=ops)   # on by default
    monkeypatch.setenv(BUS_READS_ENV, "1")
    host_expert_options(64, 32, 8, CPU, torch.float32, features, ops=ops)
    cached = StartupFeatures(host_experts=True, expert_cache_slots=2)
    host_expert_options(64, 32, 8, CPU, torch.float32, cached, ops=ops)   # a cache never reads over the bus
    monkeypatch.setenv(BUS_READS_ENV, "0")
    host_expert_options(64, 32, 8, CPU, torch.float32, features, ops=ops)
    assert asked == [moe_experts, moe_experts, None, None]
    monkeypatch.setenv(BUS_READS_ENV, "yes")
    with pytest.raises(InvalidEngineOptions, match="NINFER_HOST_BUS_READS='yes'"):
        host_expert_options(64, 32, 8, CPU, torch.float32, features, ops=ops)
