"""Routed experts in host memory, computed by the CPU (``EngineOptions.host_experts``, docs/memory.md).

On the CPU host and device are one memory, but the code path is the GPU's: the routed sum is computed by
``HostExperts`` on host copies of the rows and routing, the shared expert beside it. Checked here:

- the layer: ``HostExperts`` equals the reference ``moe_experts`` bitwise, for fp32, bf16 and quantized banks;
- the engine: greedy tokens and scoring logprobs of tiny MoE models (top-2 of 8, top-4 of 16 experts) are
  identical with and without host experts, batched, with chunked prefill and preemption;
- the planner: with host experts the banks are host-placed (``ninfer info --memory``'s host line), and when the
  model does not fit the device budget the plan moves them to the host by itself; too small a budget names both
  needs; a dense model refuses ``host_experts=True``; options are checked.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from ninfer import Engine, EngineOptions
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.contracts.sampling import SamplingParams
from ninfer.conversion import convert
from ninfer.errors import NotSupportedError
from ninfer.ops.contracts import SharedExpert
from ninfer.ops.reference.moe import moe_experts
from ninfer.ops.reference.quantized import moe_experts as quantized_moe_experts
from ninfer.planning import budget as budget_mod
from ninfer.planning import planner
from ninfer.planning.budget import MemoryPlanError
from ninfer_qwen3_5.layers.host_experts import HostExperts
from support.models import tiny_text_model, write_byte_tokenizer

GEOMETRY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
                num_hidden_layers=4, tie_word_embeddings=False, moe_intermediate_size=32,
                shared_expert_intermediate_size=48)
MOES = {"top2of8": dict(num_experts=8, num_experts_per_tok=2), "top4of16": dict(num_experts=16, num_experts_per_tok=4)}
PROMPTS = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def push(self, x):\n", "import os\nimport sys\n",
           "for i in range(10):\n    print(i * i)\n" * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("host_experts")
    out = {}
    for name, moe in MOES.items():
        torch.manual_seed(0)
        model = tiny_text_model("moe", dict(GEOMETRY, **moe), seed=5)
        model.config.architectures = ["Qwen3_5MoeForCausalLM"]
        model.config.eos_token_id = 258
        model.save_pretrained(root / name, safe_serialization=True)
        write_byte_tokenizer(root / name)
        out[name] = convert(root / name, root / f"{name}.ninfer", progress=False).paths[0]
    return out


# -- the layer -----------------------------------------------------------------------------------------------------

def _case(dtype, experts=8, k=2, tokens=5, hidden=64, inter=32, shared_inter=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    w = w / w.sum(-1, keepdim=True)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    shared = SharedExpert(projected=torch.randn(tokens, 2 * shared_inter, generator=g).to(dtype),
                          down=(torch.randn(hidden, shared_inter, generator=g) * 0.1).to(dtype),
                          gate_logit=torch.randn(tokens, generator=g))
    return x, w, ids, gate_up, down, shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [True, False])
def test_host_experts_equal_the_reference_op_bitwise(dtype, with_shared):
    x, w, ids, gate_up, down, shared = _case(dtype)
    shared = shared if with_shared else None
    want = moe_experts(x, w, ids, gate_up, down, shared=shared)
    got = HostExperts(gate_up, down)(x, w, ids, shared)
    assert got.dtype == dtype and torch.equal(got, want)
    # A routing change is seen (the comparison can fail).
    assert not torch.equal(HostExperts(gate_up, down)(x, w, ids.flip(-1), shared), want)


@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q4_g64_fp16", "fp8_e4m3fn_row_bf16"])
def test_quantized_host_banks_equal_the_quantized_reference(fmt):
    from ninfer.quant.packed import packed_view
    from ops_triton.quant_cases import parent_bytes

    x, w, ids, gate_up, down, shared = _case(torch.float32, hidden=64, inter=64)

    def pack(bank):
        parent = parent_bytes(fmt, bank.reshape(-1, bank.shape[-1]))
        return packed_view(fmt, parent, tuple(bank.shape), 0, bank.numel(), tuple(bank.shape))

    gu, dn = pack(gate_up), pack(down)
    want = quantized_moe_experts(x, w, ids, gu, dn, shared=shared)
    assert torch.equal(HostExperts(gu, dn)(x, w, ids, shared), want)
    # A quantized shared down projection too, decoded once and reused by the next call.
    packed_shared = dataclasses.replace(shared, down=pack(shared.down[None])[0])
    layer = HostExperts(gu, dn)
    want = quantized_moe_experts(x, w, ids, gu, dn, shared=packed_shared)
    assert torch.equal(layer(x, w, ids, packed_shared), want) and torch.equal(layer(x, w, ids, packed_shared), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,k,tokens", [(64, 8, 1), (8, 3, 9), (64, 8, 33)])
@pytest.mark.parametrize("skipped", ["none", "some", "all"])
def test_the_host_sum_is_the_reference_sum_bitwise(dtype, experts, k, tokens, skipped):
    """routed_sum (two GEMMs an expert, the rest once over all pairs) is routed_experts_fp32 bit for bit, with its
    pairs sorted in Python lists (8 and 27 pairs) and by tensor operations (264 pairs)."""
    from ninfer.ops.reference.moe import routed_experts_fp32
    from ninfer_qwen3_5.layers.host_compute import routed_sum

    x, w, ids, gate_up, down, _ = _case(dtype, experts=experts, k=k, tokens=tokens)
    skip = {"none": None, "some": torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.4,
            "all": torch.ones(ids.shape, dtype=torch.bool)}[skipped]
    want = routed_experts_fp32(x, w, ids, gate_up, down, skip=skip)
    got = routed_sum(x, w, ids, gate_up, down, skip=skip)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if skipped == "all":
        assert not got.any()


def test_host_experts_refuse_device_banks():
    meta = torch.empty((2, 4, 4), device="meta")
    with pytest.raises(ValueError, match="gate_up bank in host memory"):
        HostExperts(meta, meta)


# -- the engine ----------------------------------------------------------------------------------------------------

def _generate(path, **options) -> list[tuple[int, ...]]:
    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=4, max_context=256, prefill_chunk_size=16,
                         page_size=4, **options)
    with Engine.start(path, opts) as engine:
        handles = [engine.submit(p, sampling=GREEDY) for p in PROMPTS]
        return [tuple(h.result().token_ids) for h in handles]


@pytest.mark.parametrize("name", list(MOES))
def test_greedy_tokens_equal_with_and_without_host_experts(artifacts, name):
    plain = _generate(artifacts[name], host_experts=False)
    hosted = _generate(artifacts[name], host_experts=True)
    assert hosted == plain and all(len(t) == 24 for t in plain)


def test_preempted_and_scored_equal(artifacts):
    path = artifacts["top2of8"]
    # A pool of few pages forces preemption and Replay.
    assert _generate(path, host_experts=True, num_pages=80) == _generate(path, host_experts=False, num_pages=80)
    reports = []
    for host in (False, True):
        with Engine.start(path, device="cpu", dtype="float32", purpose="causal_scoring", host_experts=host) as eng:
            reports.append([t.logprob for t in eng.score([PROMPTS[3]], logprobs=True).texts[0].token_logprobs])
    assert reports[0] == reports[1]


def test_host_experts_are_host_placed_and_shown(artifacts):
    plan = planner.plan(artifacts["top4of16"], EngineOptions(device="cpu", dtype="float32", host_experts=True))
    summary = plan.summary()
    hosted = [s for s in plan.model.parameter_specs if s.placement == "host"]
    # Every layer's banks, and the input embedding (an untied table the device reads a row of per token).
    assert {s.name.rsplit("/", 1)[-1] for s in hosted} == {"gate_up", "down", "embed"} and len(hosted) == 2 * 4 + 1
    assert summary.host_weights_bytes == plan.model.profile.host_weight_bytes > 0
    plain = planner.plan(artifacts["top4of16"], EngineOptions(device="cpu", dtype="float32"))
    assert plain.model.profile.host_weight_bytes == 0
    stage = 8 * 3 * 32 * 64 * 4   # the copy path's staging buffer: 8 experts x (gate, up, down) x I x H x fp32
    assert (plain.model.profile.weight_bytes + stage
            == plan.model.profile.weight_bytes + plan.model.profile.host_weight_bytes)


def _fake_gpu(monkeypatch, budget_bytes: int):
    """The planner sees a non-CPU device budget of ``budget_bytes`` (the model itself still runs on the CPU)."""
    fake = budget_mod.DeviceBudget("cuda:0", budget_bytes, 0, "test")
    monkeypatch.setattr(planner, "device_budget", lambda device, env=None: fake)


def test_auto_places_experts_on_the_host_when_they_do_not_fit(artifacts, monkeypatch):
    path = artifacts["top4of16"]
    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=1, max_context=64, num_pages=16,
                         expert_cache_slots=0)
    _fake_gpu(monkeypatch, 1 << 40)
    hosted = planner.plan(path, dataclasses.replace(opts, host_experts=True))
    full = planner.plan(path, opts)
    assert full.options.options.host_experts is None and full.model.profile.host_weight_bytes == 0
    # Between what the model needs on a GPU with its experts on the host and with them on the device.
    need_hosted = hosted.memory.summary(torch.float32).planned_bytes
    need_full = full.memory.summary(torch.float32).planned_bytes
    assert need_hosted < need_full
    _fake_gpu(monkeypatch, (need_hosted + need_full) // 2)
    auto = planner.plan(path, opts)
    assert auto.options.options.host_experts is True and auto.model.profile.host_weight_bytes > 0
    assert auto.options.graph_batches == 0 and auto.options.lookahead_slots == 0
    with pytest.raises(MemoryPlanError):
        planner.plan(path, dataclasses.replace(opts, host_experts=False))   # explicit: never moved
    _fake_gpu(monkeypatch, need_hosted // 2)
    with pytest.raises(MemoryPlanError, match="with the routed experts in host memory; with them on the device"):
        planner.plan(path, opts)


def test_a_host_without_room_for_the_experts_is_refused_with_the_numbers(artifacts, monkeypatch):
    # The host budget is checked when the device is not the host (a CUDA run): the plan of a GPU run with its banks
    # on a host budget of half what they take.
    from ninfer.planning.memory import plan_memory

    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=1, max_context=64, num_pages=16,
                         expert_cache_slots=0, host_experts=True)
    _fake_gpu(monkeypatch, 1 << 40)
    hosted = planner.plan(artifacts["top4of16"], opts)
    banks = hosted.model.profile.host_weight_bytes
    small = budget_mod.DeviceBudget("host", banks // 2, 0, f"{budget_mod.HOST_BUDGET_ENV}=test")
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(hosted.model.options, hosted.model.profile, budget_mod.DeviceBudget("cuda:0", 1 << 40, 0, "test"),
                    load_bytes=0, host_load_bytes=banks, host_budget=small)
    msg = str(err.value)
    assert f"the weights placed in host memory ({budget_mod.mib(banks)}" in msg
    assert budget_mod.HOST_BUDGET_ENV in msg and "free host memory" in msg


def test_dense_models_refuse_host_experts(default_artifact):
    with pytest.raises(NotSupportedError, match="dense, it has no routed experts"):
        Engine.start(default_artifact, device="cpu", host_experts=True)


def test_options_are_checked():
    with pytest.raises(InvalidEngineOptions, match="vram_budget_mib"):
        EngineOptions(vram_budget_mib=0).validate()
    with pytest.raises(InvalidEngineOptions, match="host_experts"):
        EngineOptions(host_experts="yes").validate()
    with pytest.raises(InvalidEngineOptions, match="no lookahead"):
        EngineOptions(host_experts=True, lookahead=True).validate()


def test_vram_budget_option_caps_the_plan(artifacts, monkeypatch):
    """The option caps the plan, and the refusal names the option that set the budget, not the environment
    variable it is passed through (which the user did not set)."""
    monkeypatch.delenv("NINFER_VRAM_BUDGET_MIB", raising=False)
    with pytest.raises(MemoryPlanError, match=r"\[--vram-budget-mib=0\].*raise --vram-budget-mib") as info:
        planner.plan(artifacts["top2of8"], EngineOptions(device="cpu", dtype="float32", vram_budget_mib=0.5))
    assert "[NINFER_VRAM_BUDGET_MIB=" not in str(info.value)


# -- the device cache of host experts ------------------------------------------------------------------------------

def test_expert_cache_follows_the_routing():
    from ninfer_qwen3_5.layers.expert_cache import ExpertCache

    gate_up, down = torch.randn(6, 4, 3), torch.randn(6, 3, 2)
    cache = ExpertCache(gate_up, down, 2, torch.device("cpu"), torch.float32)
    cache.refresh()
    assert cache.expert_in == [-1, -1]          # nothing routed yet: nothing cached
    cache.observe(torch.tensor([[4, 1], [4, 1], [4, 5]]))
    cache.refresh()
    assert sorted(cache.expert_in) == [1, 4]
    for slot, expert in enumerate(cache.expert_in):
        assert cache.slot_of[expert] == slot
        assert torch.equal(cache.gate_up[slot], gate_up[expert]) and torch.equal(cache.down[slot], down[expert])
    cached, slot = cache.split(torch.tensor([[4, 5]]))
    assert cached.tolist() == [[True, False]] and slot[0, 0] == cache.slot_of[4]
    assert (cache.hits, cache.misses) == (1, 1)
    for _ in range(3):                            # expert 5 takes over from 1, the worse of the cached two
        cache.observe(torch.tensor([[5, 4], [5, 4]]))
    cache.refresh()
    assert sorted(cache.expert_in) == [4, 5] and cache.slot_of[1] == -1
    with pytest.raises(ValueError, match="1..6 slots"):
        ExpertCache(gate_up, down, 7, torch.device("cpu"), torch.float32)


def test_a_settled_cache_is_one_a_refresh_leaves_as_it_is():
    """``settled()`` (a few tensor ops, checked before each refresh) says exactly whether the Python walk of a
    refresh would copy anything, over random routing histories with and without favourites."""
    from ninfer_qwen3_5.layers.expert_cache import ExpertCache

    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.zeros(32, 2, 2), torch.zeros(32, 2, 2)
    seen = {True: 0, False: 0}
    for trial in range(40):
        cache = ExpertCache(gate_up, down, 6, torch.device("cpu"), torch.float32)
        skew = torch.rand(32, generator=g) ** (1 + trial % 4 * 3)
        for _ in range(30):
            ids = torch.multinomial(skew, 4, generator=g).view(1, 4)
            cache.observe(ids)
            settled, before = cache.settled(), cache.copies
            cache.refresh()
            assert settled == (cache.copies == before), (trial, cache.expert_in)
            seen[settled] += 1
    assert seen[True] > 100 and seen[False] > 40


def test_expert_cache_does_not_churn_on_routing_without_favourites():
    """Uniform routing (top-8 of 64, 16 slots): after the cache fills, near-ties do not swap experts, so most calls
    copy nothing and none copies more than MAX_ADMITS; routing with favourites gets them cached."""
    from ninfer_qwen3_5.layers.expert_cache import MAX_ADMITS, ExpertCache

    g = torch.Generator().manual_seed(0)
    experts, slots, k = 64, 16, 8

    def run(pick) -> ExpertCache:
        cache = ExpertCache(torch.zeros(experts, 2, 2), torch.zeros(experts, 2, 1), slots, torch.device("cpu"),
                            torch.float32)
        per_call = []
        for _ in range(400):
            before = cache.copies
            cache.refresh()
            per_call.append(cache.copies - before)
            ids = pick()[None]
            cache.split(ids)
            cache.observe(ids)
        assert max(per_call[1:]) <= max(MAX_ADMITS, slots - k)   # the second call may still fill empty slots
        return cache, per_call

    cache, per_call = run(lambda: torch.randperm(experts, generator=g)[:k])
    assert sum(c > 0 for c in per_call[100:]) < 100          # at least 3 calls in 4 copy nothing
    hot = torch.arange(4)                                     # experts 0-3 in every call
    cache, _ = run(lambda: torch.cat([hot, 4 + torch.randperm(experts - 4, generator=g)[:k - 4]]))
    assert set(range(4)) <= set(cache.expert_in)
    assert cache.hits / (cache.hits + cache.misses) > 0.5 > slots / experts


def _fp64_moe(x, w, ids, gate_up, down, shared):
    return moe_experts(x.double(), w.double(), ids, gate_up.double(), down.double(),
                       shared=SharedExpert(shared.projected.double(), shared.down.double(), shared.gate_logit.double()))


@pytest.mark.parametrize("experts,k,tokens", [(8, 2, 7), (256, 8, 1), (256, 8, 24), (512, 10, 1), (512, 10, 24)])
@pytest.mark.parametrize("slots,rounds", [("all", 0), ("all", 3), (3, 3), (1, 2)])
def test_cached_host_experts_against_fp64(experts, k, tokens, slots, rounds):
    """None cached (the first call), all cached (every expert after routing was seen) and mixed, at Qwen3.5-MoE's
    top-8 of 256 and Qwen4-Exp's top-10 of 512 (one token: decode; 24: a prefill chunk): within fp32 rounding of
    the fp64 oracle, and bitwise the uncached result while nothing is cached."""
    ops = types.SimpleNamespace(moe_experts=moe_experts)   # the CPU's device op
    slots = experts if slots == "all" else slots
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=experts, k=k, tokens=tokens, hidden=32,
                                             inter=16, shared_inter=24)
    layer = HostExperts(gate_up, down, cache_slots=slots, ops=ops, device=torch.device("cpu"), dtype=torch.float32)
    for _ in range(rounds):
        layer(x, w, ids, shared)
    hits, misses = layer.cache.hits, layer.cache.misses
    got = layer(x, w, ids, shared)
    hits, misses = layer.cache.hits - hits, layer.cache.misses - misses
    want = _fp64_moe(x, w, ids, gate_up, down, shared)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    assert hits + misses == ids.numel()
    if rounds == 0:
        assert hits == 0 and torch.equal(got, moe_experts(x, w, ids, gate_up, down, shared=shared))
    else:   # every expert the step routes to, once seen, is cached when the slots hold them all
        assert hits > 0 and (misses == 0) == (slots >= len(set(ids.reshape(-1).tolist())))


@pytest.mark.parametrize("slots", [2, 8])
def test_greedy_tokens_equal_with_an_expert_cache(artifacts, slots):
    plain = _generate(artifacts["top2of8"], host_experts=False)
    assert _generate(artifacts["top2of8"], host_experts=True, expert_cache_slots=slots) == plain


def test_expert_cache_options(artifacts):
    with pytest.raises(InvalidEngineOptions, match="needs host_experts"):
        EngineOptions(expert_cache_slots=2, host_experts=False).validate()
    with pytest.raises(NotSupportedError, match="at most that many can be cached"):
        planner.plan(artifacts["top2of8"], EngineOptions(device="cpu", host_experts=True, expert_cache_slots=9))
    base = planner.plan(artifacts["top2of8"], EngineOptions(device="cpu", dtype="float32", host_experts=True))
    cached = planner.plan(artifacts["top2of8"], EngineOptions(device="cpu", dtype="float32", host_experts=True,
                                                              expert_cache_slots=2))
    per_expert = 3 * 32 * 64 * 4
    assert cached.model.profile.weight_bytes - base.model.profile.weight_bytes == 4 * 2 * per_expert


def test_the_cache_fills_what_the_budget_leaves(artifacts, monkeypatch, tmp_path):
    """With an expert routing file given (whether or not a run has written it yet): without one the automatic
    cache stays empty."""
    path = artifacts["top2of8"]
    record = tmp_path / "routing.json"
    record.write_text("{}")
    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=1, max_context=64, num_pages=16,
                         host_experts=True, device_expert_layers=0,   # whole device layers: test_device_expert_layers
                         expert_routing_file=str(record))
    _fake_gpu(monkeypatch, 1 << 40)
    assert planner.plan(path, dataclasses.replace(opts, expert_routing_file=None)).options.options \
        .expert_cache_slots == 0
    assert planner.plan(path, dataclasses.replace(opts, expert_routing_file=str(tmp_path / "none.json"))) \
        .options.options.expert_cache_slots == 8   # a first run: it writes the record at close
    none = planner.plan(path, dataclasses.replace(opts, expert_cache_slots=0))
    one = planner.plan(path, dataclasses.replace(opts, expert_cache_slots=1))
    per_slot = one.model.profile.weight_bytes - none.model.profile.weight_bytes
    assert per_slot == 4 * 3 * 32 * 64 * 4          # 4 layers x (gate, up, down) x I x H x fp32
    need = max(none.memory.runtime_bytes, none.memory.startup_peak_bytes)
    assert planner.plan(path, opts).options.options.expert_cache_slots == 8   # room for every expert
    for room, slots in ((2.5, 2), (0.5, 0)):
        _fake_gpu(monkeypatch, need + int(room * per_slot))
        auto = planner.plan(path, opts)
        assert (auto.options.options.expert_cache_slots or 0) == slots
        assert auto.model.profile.weight_bytes == none.model.profile.weight_bytes + slots * per_slot
    _fake_gpu(monkeypatch, need + 3 * per_slot)
    assert planner.plan(path, dataclasses.replace(opts, expert_cache_slots=0)).options.options.expert_cache_slots == 0
    # Moved to the host by the planner (host_experts unset: all 8 experts on the device need more), the cache fills
    # the room too.
    auto = planner.plan(path, dataclasses.replace(opts, host_experts=None, device_expert_layers=None))
    assert auto.options.options.host_experts is True
    # Room for 3 slots on each of 4 layers: one whole layer (8 experts) first, then 4 experts over the 3 host layers.
    assert auto.options.options.device_expert_layers == 1 and auto.options.options.expert_cache_slots == 1


def test_graph_calibration_takes_the_automatic_cache_before_the_kv(artifacts, monkeypatch, tmp_path):
    """The plan fills the room it leaves with 3 cache slots per layer (the automatic cache needs a routing file;
    the reference run below writes it); the (faked) graph capture then leaves 1.5 slots' worth too little free, so
    the one corrective rebuild builds the Program with 1 slot and every planned KV page (the cache is what the plan
    sized last). It serves what an engine started with 1 slot serves."""
    from ninfer.contracts.memory import format_memory_summary
    from ninfer.engine import model_construction as mc
    from ninfer.planning import calibration as cal
    from ninfer.planning import resolution

    path = artifacts["top2of8"]
    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=2, max_context=64, page_size=4,
                         prefill_chunk_size=16, host_experts=True, device_expert_layers=0,
                         expert_routing_file=str(tmp_path / "routing.json"))
    with Engine.start(path, dataclasses.replace(opts, expert_cache_slots=1)) as engine:
        reference = [engine.generate(p, sampling=GREEDY).token_ids for p in PROMPTS[:2]]
        one_slot = engine.memory_summary()
    monkeypatch.setattr(resolution, "graph_batches", lambda device, options: options.max_concurrency)
    _fake_gpu(monkeypatch, 1 << 40)
    none = planner.plan(path, dataclasses.replace(opts, expert_cache_slots=0))
    per_slot = planner.plan(path, dataclasses.replace(opts, expert_cache_slots=1)).model.profile.weight_bytes \
        - none.model.profile.weight_bytes
    _fake_gpu(monkeypatch, max(none.memory.runtime_bytes, none.memory.startup_peak_bytes) + int(3.5 * per_slot))
    planned = planner.plan(path, opts)
    assert (planned.options.options.expert_cache_slots, planned.memory.cache_slots) == (3, 3)
    assert planned.memory.slot_bytes == per_slot

    measured, built = [], []

    def measure(device, budget, probe, *, pending_bytes, released_bytes):
        measured.append(budget.headroom_bytes - (int(1.5 * per_slot) if not measured else 0))
        return measured[-1]

    def capture(program, max_batch, device):
        built.append(program)
        return (1, 2), 5 << 20

    monkeypatch.setattr(mc, "_capture_graphs", capture)
    monkeypatch.setattr(mc, "runtime_free_bytes", measure)
    monkeypatch.setattr(cal, "calibration_margin", lambda deficit: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    with Engine.start(path, opts) as engine:
        m = engine.memory_summary()
        assert len(measured) == 2 and len(built) == 2 and engine.options.expert_cache_slots == 1
        assert (m.cache_slots_before_rebuild, m.cache_slots_after_rebuild, m.kv_pages_before_rebuild) == (3, 1, 0)
        assert m.num_pages == planned.memory.num_pages == engine.stats().pages_total
        assert m.weights_bytes == planned.memory.weights_bytes - 2 * per_slot
        assert m.startup_retained_bytes == one_slot.startup_retained_bytes   # the Program holds one slot a layer
        assert "expert cache shrunk from 3 to 1 slots per layer after calibration" in format_memory_summary(m)
        assert engine.info["memory"]["cache_slots_before_rebuild"] == 3
        assert [engine.generate(p, sampling=GREEDY).token_ids for p in PROMPTS[:2]] == reference


def test_cache_hits_reach_the_stats_and_metrics(artifacts):
    from ninfer_serve.metrics import EngineCollector

    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=4, max_context=256, prefill_chunk_size=16,
                         page_size=4, host_experts=True, expert_cache_slots=4)
    with Engine.start(artifacts["top2of8"], opts) as engine:
        result = engine.generate(PROMPTS[0], sampling=GREEDY)
        engine.generate(PROMPTS[1], sampling=GREEDY)   # the first request's last step is published by now
        stats = engine.stats()
    families = {f.name: f for f in EngineCollector(lambda: stats).collect()}
    first = (result.usage.prompt_tokens + len(result.token_ids) - 1) * 2   # tokens computed x top-2, per layer
    totals = [h + m for h, m in zip(stats.expert_cache_hits, stats.expert_cache_misses, strict=True)]
    assert len(totals) == 4 and len(set(totals)) == 1 and totals[0] > first and totals[0] % 2 == 0
    rates = stats.expert_cache_hit_rate_by_layer()
    assert all(0.0 < r < 1.0 for r in rates)       # 4 of 8 experts cached after the first calls
    hits = {s.labels["layer"]: s.value for s in families["ninfer_expert_cache_hits"].samples
            if s.name.endswith("_total")}
    assert [hits[str(i)] for i in range(4)] == list(stats.expert_cache_hits)


# -- the copy path -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("min_tokens,cache", [(1, 0), (3, 0), (2, 3), (100, 0)])
def test_copied_experts_against_fp64(min_tokens, cache):
    """Busy experts (at least ``min_tokens`` of the call's tokens) are staged on the device, in groups of the stage's
    slots (2 here, so several groups); cached ones are not copied; the sum stays within fp32 rounding of fp64."""
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    ops = types.SimpleNamespace(moe_experts=moe_experts)
    x, w, ids, gate_up, down, shared = _case(torch.float32, tokens=9, k=3)
    stage = ExpertStage(torch.device("cpu"), torch.float32, slots=2)
    layer = HostExperts(gate_up, down, cache_slots=cache, ops=ops, device=torch.device("cpu"), dtype=torch.float32,
                        copy_min_tokens=min_tokens, stage=stage)
    layer(x, w, ids, shared)    # the cache (if any) sees the routing
    before = layer.copied_experts
    cached = set(layer.cache.expert_in) if cache else set()   # what the call finds cached
    got = layer(x, w, ids, shared)
    assert torch.allclose(got.double(), _fp64_moe(x, w, ids, gate_up, down, shared), rtol=1e-5, atol=1e-6)
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    busy = {e for e in range(8) if counts[e] >= min_tokens and e not in cached}
    assert layer.copied_experts - before == len(busy)
    with pytest.raises(ValueError, match="needs an ExpertStage"):
        HostExperts(gate_up, down, ops=ops, copy_min_tokens=1)


def test_the_cost_model_follows_the_host_time_the_layer_measures(monkeypatch):
    """With adapt_costs, a host share that takes longer than the cost model estimated raises host_scale towards the
    measured ratio, and the layer then copies more of its uncached experts; without it nothing changes."""
    from ninfer_qwen3_5.layers import host_experts as he
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    now = [0.0]
    monkeypatch.setattr(he, "_clock", lambda: now[0])
    real_sum = he.routed_sum

    def slow_sum(*args, **kwargs):   # every host share takes 50 (fake) seconds
        now[0] += 50.0
        return real_sum(*args, **kwargs)

    monkeypatch.setattr(he, "routed_sum", slow_sum)
    ops = types.SimpleNamespace(moe_experts=moe_experts)
    x, w, ids, gate_up, down, shared = _case(torch.float32, tokens=9, k=3)
    costs = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5)
    layers = {adapt: HostExperts(gate_up, down, ops=ops, device=torch.device("cpu"), dtype=torch.float32,
                                 costs=costs, adapt_costs=adapt,
                                 stage=ExpertStage(torch.device("cpu"), torch.float32, slots=2))
              for adapt in (False, True)}
    copied = {}
    for adapt, layer in layers.items():
        for _ in range(30):
            got = layer(x, w, ids, shared)
        assert torch.allclose(got.double(), _fp64_moe(x, w, ids, gate_up, down, shared), rtol=1e-5, atol=1e-6)
        before = layer.copied_experts
        layer(x, w, ids, shared)
        copied[adapt] = layer.copied_experts - before
    assert layers[False].host_scale == 1.0
    assert layers[True].host_scale > 5.0      # 50 s measured against a few seconds estimated
    assert copied[True] > copied[False] > 0


@pytest.mark.slow   # two torch.compile builds of the kernel (tens of seconds on a small CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_host_kernel_against_fp64(dtype):
    """host_expert_kernel="compiled": one compiled kernel for every pair of a call, a single pair padded; the layer's
    sum is the fp64 oracle's within the dtype's rounding, with and without a cache and copies."""
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_compute import compiled_rows, routed_sum
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    x, w, ids, gate_up, down, shared = _case(dtype, tokens=9, k=3)
    rows = compiled_rows(64, 32, dtype)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    ref = _fp64_moe(x.float(), w, ids, gate_up.float(), down.float(),
                    type(shared)(shared.projected.float(), shared.down.float(), shared.gate_logit))
    ops = types.SimpleNamespace(moe_experts=moe_experts)
    for extra in ({}, {"cache_slots": 3, "costs": ExpertCosts(1.0, 1.0, 0.5),
                       "stage": ExpertStage(torch.device("cpu"), dtype, slots=2)}):
        layer = HostExperts(gate_up, down, ops=ops, device=torch.device("cpu"), dtype=dtype, rows=rows, **extra)
        for _ in range(2):
            got = layer(x, w, ids, shared)
        assert ((got.double() - ref).norm() / ref.norm()) < tol
    one = torch.ones_like(ids, dtype=torch.bool)
    one[4, 1] = False   # a single pair left for the host: padded to two rows
    want = routed_sum(x, w, ids, gate_up, down, skip=one)
    got = routed_sum(x, w, ids, gate_up, down, skip=one, rows=rows)
    assert ((got - want).norm() / want.norm()) < tol   # the same roundings, in another summation order
    assert got[4].abs().sum() > 0 and got[torch.arange(9) != 4].abs().sum() == 0


def test_copied_experts_enter_the_cache_unless_the_call_reads_the_slot():
    """An expert the copy path copies anyway takes an empty cache slot, or the slot of a worse-scored cached expert
    the call does not read; the rest are staged. Every call's sum stays the fp64 oracle's."""
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    ops = types.SimpleNamespace(moe_experts=moe_experts)
    x, _, _, gate_up, down, shared = _case(torch.float32, experts=8, k=2, tokens=4)
    w = torch.softmax(torch.randn(4, 2, generator=torch.Generator().manual_seed(2)), -1)
    stage = ExpertStage(torch.device("cpu"), torch.float32, slots=2)
    layer = HostExperts(gate_up, down, cache_slots=2, ops=ops, device=torch.device("cpu"), dtype=torch.float32,
                        copy_min_tokens=1, stage=stage)

    def call(ids):
        ids = torch.tensor(ids)
        got = layer(x, w, ids, shared)
        assert torch.allclose(got.double(), _fp64_moe(x, w, ids, gate_up, down, shared), rtol=1e-5, atol=1e-6)

    call([[0, 1], [0, 1], [0, 2], [0, 3]])     # empty cache: the two busiest (0, 1) take its slots, 2 and 3 staged
    assert sorted(layer.cache.expert_in) == [0, 1] and layer.copied_experts == 4
    assert (layer.cache.hits, layer.cache.misses) == (0, 8)
    slot_of_1 = int(layer.cache.slot_of[1])
    call([[1, 4], [4, 5], [4, 5], [4, 6]])     # 4 outscores 0 and takes its slot; 1 is read by the call: kept
    assert sorted(layer.cache.expert_in) == [1, 4] and int(layer.cache.slot_of[1]) == slot_of_1
    assert layer.copied_experts == 4 + 3 and (layer.cache.hits, layer.cache.misses) == (1, 15)
    call([[4, 1], [4, 1], [5, 1], [4, 0]])     # all but 5 and 0 cached now; both worse than 4 and 1: staged
    assert sorted(layer.cache.expert_in) == [1, 4] and layer.copied_experts == 7 + 2


@pytest.mark.parametrize("min_tokens", [1, 4])
def test_greedy_tokens_equal_with_copied_experts(artifacts, min_tokens):
    plain = _generate(artifacts["top2of8"], host_experts=False)
    assert _generate(artifacts["top2of8"], host_experts=True, expert_copy_min_tokens=min_tokens) == plain


def test_host_threads_default_to_one_a_physical_core(tmp_path, monkeypatch):
    from ninfer_qwen3_5.layers import host_threads as threads_module
    from ninfer_qwen3_5.layers.host_threads import cpu_quota, host_threads, physical_cores

    def topology(siblings: dict[int, str]) -> str:
        root = tmp_path / f"sys{len(list(tmp_path.iterdir()))}"
        for cpu, listed in siblings.items():
            (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
            (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(listed + "\n")
        return str(root)

    smt = topology({0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"})
    assert physical_cores(list(range(8)), smt) == 4
    assert physical_cores([0, 4], smt) == 1   # the two threads of one core
    assert physical_cores([0, 1, 5], smt) == 2
    plain = topology({c: str(c) for c in range(6)})   # no SMT (or a guest that does not show it)
    assert physical_cores(list(range(6)), plain) == 6
    assert physical_cores([0, 9], plain) is None   # a CPU without a topology entry: unknown

    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(threads_module, "cpu_quota", lambda: None)
    monkeypatch.setattr(threads_module, "physical_cores", lambda cpus: physical_cores(cpus, smt))
    assert host_threads(torch.device("cuda"), None) == 4
    monkeypatch.setattr(threads_module, "cpu_quota", lambda: 3)
    assert host_threads(torch.device("cuda"), None) == 3   # a container's quota of 3 CPUs
    monkeypatch.setattr(threads_module, "cpu_quota", lambda: None)
    monkeypatch.setattr(threads_module, "physical_cores", lambda cpus: None)
    assert host_threads(torch.device("cuda"), None) == 4   # unreadable topology: half the CPUs
    quota = tmp_path / "cpu.max"
    for text, want in (("max 100000\n", None), ("250000 100000\n", 3), ("50000 100000\n", 1), ("bad", None)):
        quota.write_text(text)
        assert cpu_quota(str(quota)) == want
    assert cpu_quota(str(tmp_path / "none")) is None
    assert host_threads(torch.device("cuda"), 7) == 7
    assert host_threads(torch.device("cpu"), None) is None


def test_copy_threshold_options():
    from ninfer_qwen3_5.layers.expert_costs import measure_expert_costs
    from ninfer_qwen3_5.layers.host_options import host_expert_options
    from ninfer_qwen3_5.layers.host_threads import host_threads

    assert measure_expert_costs(64, 32, torch.device("cpu"), torch.float32) is None   # one memory: never copy
    from ninfer.contracts.features import StartupFeatures

    cpu = host_expert_options(64, 32, 8, torch.device("cpu"), torch.float32, StartupFeatures(host_experts=True))
    assert cpu["costs"] is None and cpu["stage"] is None and cpu["threads"] is None   # torch's count kept
    assert host_threads(torch.device("cpu"), 3) == 3
    assert host_threads(torch.device("cuda"), None) >= 1
    with pytest.raises(InvalidEngineOptions, match="expert_copy_min_tokens"):
        EngineOptions(expert_copy_min_tokens=0).validate()
    for bad in (0, True, 1.5):
        with pytest.raises(InvalidEngineOptions, match="host_expert_threads"):
            EngineOptions(host_expert_threads=bad).validate()
    assert EngineOptions(host_experts=True, host_expert_threads=2).features().host_expert_threads == 2
    assert EngineOptions(host_experts=False, host_expert_threads=2).features().host_expert_threads is None
    with pytest.raises(InvalidEngineOptions, match="host_expert_kernel"):
        EngineOptions(host_expert_kernel="fast").validate()
    assert EngineOptions(host_experts=True, host_expert_kernel="compiled").features().host_expert_kernel == "compiled"
    assert EngineOptions(host_experts=True).features().host_expert_kernel == "auto"


def test_the_cost_model_balances_the_copy_engine_against_the_host():
    """The busiest uncached experts go to the copy engine while that lowers the later of the two finishing times;
    the host keeps the rest."""
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts

    even = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5)
    assert even.host_cost(1) == 1.0 and even.host_cost(3) == 2.0
    assert even.copies([]) == 0
    assert even.copies([1]) == 0                      # host 1 vs copy 1: no gain
    assert even.copies([1, 1]) == 1                   # 1 and 1 at once
    assert even.copies([5, 1, 1, 1]) == 2             # the busy one (3 s on the host), then one more: 2 and 2
    assert even.copies([1] * 8) == 4                  # halves
    slow_host = ExpertCosts(copy_s=1.0, host_s=3.0, host_token_s=1.0)
    assert slow_host.copies([1] * 8) == 6             # 6 copies (6 s) against 2 on the host (6 s)
    slow_copy = ExpertCosts(copy_s=10.0, host_s=1.0, host_token_s=0.1)
    assert slow_copy.copies([1] * 8) == 0 and slow_copy.copies([100, 1]) == 1
    with pytest.raises(ValueError, match="must be > 0"):
        ExpertCosts(copy_s=0.0, host_s=1.0, host_token_s=1.0)


def test_the_cost_model_counts_the_hosts_issue_of_the_device_share():
    """The host thread queues the copies and the device call before it computes its own share, so that time delays
    both sides: a copy pays only where it still lowers the later finish after its issue."""
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts, IssueCosts

    even = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5)
    assert even.copies([1] * 8, issue=IssueCosts()) == even.copies([1] * 8) == 4   # unmeasured: free
    assert even.copies([1] * 8, issue=IssueCosts(call_s=2.5, expert_s=0.0)) == 4   # 2.5 + 4 against 8
    assert even.copies([1] * 8, issue=IssueCosts(call_s=4.5, expert_s=0.0)) == 0   # 4.5 + 4 against 8
    assert even.copies([1] * 8, issue=IssueCosts(call_s=0.0, expert_s=1.0)) == 0   # an expert's issue = its compute
    assert even.copies([9, 1, 1], issue=IssueCosts(call_s=1.0, expert_s=0.5)) == 1  # the busy one still pays
    issue = IssueCosts(rate=0.5)
    assert issue.of(3) == 0.0
    issue.observe("call_s", 4.0)      # the first measurement is taken whole
    issue.observe("call_s", 2.0)      # then averaged at the rate
    issue.observe("expert_s", 1.0)
    assert (issue.call_s, issue.expert_s) == (3.0, 1.0)
    assert issue.of(0) == 0.0 and issue.of(2) == 5.0
    issue.observe("expert_s", 100.0, ceiling=3.0)   # an outlier (a compiling call) counts as the ceiling
    assert issue.expert_s == 2.0


@pytest.mark.parametrize("adapt", [False, True])
def test_a_costly_device_call_leaves_the_pairs_to_the_host(adapt, monkeypatch):
    """With adapt_costs, a layer that measures its device calls (routing copies and launches) as costing the host
    more than computing the pairs stops making them: the cached pairs are computed on the host, which holds every
    expert, and nothing is copied; the sum stays the fp64 oracle's. Without it every call goes as before."""
    from ninfer_qwen3_5.layers import host_experts as he
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    now = [0.0]
    monkeypatch.setattr(he, "_clock", lambda: now[0])

    def slow_device(*args, **kwargs):   # every device call takes the host 50 (fake) seconds to queue
        now[0] += 50.0
        return moe_experts(*args, **kwargs)

    ops = types.SimpleNamespace(moe_experts=slow_device)
    x, w, ids, gate_up, down, shared = _case(torch.float32, tokens=9, k=3)
    costs = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5)
    layer = HostExperts(gate_up, down, cache_slots=3, ops=ops, device=torch.device("cpu"), dtype=torch.float32,
                        costs=costs, adapt_costs=adapt, stage=ExpertStage(torch.device("cpu"), torch.float32, 2))
    for _ in range(3):
        layer(x, w, ids, shared)
    copied, on_host = layer.copied_experts, layer.cached_on_host
    got = layer(x, w, ids, shared)
    assert torch.allclose(got.double(), _fp64_moe(x, w, ids, gate_up, down, shared), rtol=1e-5, atol=1e-6)
    hits = int(torch.isin(ids, torch.tensor(sorted(layer.cache.expert_in))).sum())
    assert hits > 0
    if adapt:
        assert layer.issue.call_s == he.ISSUE_CEILING * costs.host_s   # 50 s measured, clamped
        assert layer.copied_experts == copied and layer.cached_on_host - on_host == hits
    else:
        assert layer.issue.call_s is None and layer.cached_on_host == 0 and layer.copied_experts > copied


@pytest.mark.parametrize("cache", [0, 3])
@pytest.mark.parametrize("tokens,k", [(9, 3), (80, 2)])
def test_cost_model_copies_against_fp64(cache, tokens, k):
    """With measured costs instead of a threshold, the copied experts are the busiest ones the cost model picks (its
    pairs counted in lists for 27 pairs, by tensor operations for 160), and the layer's sum is the fp64 oracle's
    within fp32 rounding."""
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    ops = types.SimpleNamespace(moe_experts=moe_experts)
    x, w, ids, gate_up, down, shared = _case(torch.float32, tokens=tokens, k=k)
    stage = ExpertStage(torch.device("cpu"), torch.float32, slots=2)
    costs = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5)
    layer = HostExperts(gate_up, down, cache_slots=cache, ops=ops, device=torch.device("cpu"), dtype=torch.float32,
                        costs=costs, stage=stage, threads=torch.get_num_threads())
    layer(x, w, ids, shared)
    before = layer.copied_experts
    cached = set(layer.cache.expert_in) if cache else set()   # what the call finds cached
    got = layer(x, w, ids, shared)
    assert torch.allclose(got.double(), _fp64_moe(x, w, ids, gate_up, down, shared), rtol=1e-5, atol=1e-6)
    counts = torch.bincount(ids.reshape(-1), minlength=8).tolist()
    left = sorted((counts[e] for e in range(8) if counts[e] and e not in cached), reverse=True)
    assert layer.copied_experts - before == costs.copies(left) > 0
    with pytest.raises(ValueError, match="needs an ExpertStage"):
        HostExperts(gate_up, down, ops=ops, costs=costs)


def test_a_bank_that_does_not_split_per_expert_is_refused():
    from ninfer.quant.packed import packed_view
    from ops_triton.quant_cases import parent_bytes

    w = torch.randn(4 * 64, 64)   # nvfp4 experts of 64 rows share 128-row scale tiles
    bank = packed_view("nvfp4", parent_bytes("nvfp4", w), (4, 64, 64), 0, w.numel(), (4, 64, 64))
    with pytest.raises(NotSupportedError, match="stored expert by expert; this nvfp4 gate_up bank of shape"):
        HostExperts(bank, bank)


def test_speculative_verify_through_host_experts(artifacts, tmp_path):
    """A DFlash drafter on a host-expert MoE target: verify forwards (k + 1 rows a request) run the host path and
    the greedy tokens stay plain decoding's, with and without a cache and copies."""
    from support.dflash import write_dflash_drafter

    folder = write_dflash_drafter(tmp_path / "drafter", seed=3, hidden_size=64, vocab_size=512, num_target_layers=4,
                                  target_layer_ids=[1, 2], block_size=4, mask_token_id=511, head_dim=16, heads=4,
                                  kv_heads=2, intermediate=64, generation=1)
    source = artifacts["top2of8"].with_suffix("")   # the checkpoint folder the fixture converted
    art = convert(source, tmp_path / "with_drafter.ninfer", progress=False, draft=folder).paths[0]
    plain = _generate(artifacts["top2of8"], host_experts=False)
    for extra in ({}, {"expert_cache_slots": 3, "expert_copy_min_tokens": 2}):
        got = _generate(art, host_experts=True, speculative="dflash", num_speculative_tokens=3, **extra)
        assert got == plain, extra


def test_bench_reports_the_cache(artifacts, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "bench", str(artifacts["top2of8"]), "--device", "cpu",
                          "--host-experts", "--expert-cache-slots", "4", "--batches", "1", "--prefill-lengths", "16",
                          "--decode-prompt-tokens", "8", "--decode-base-tokens", "2", "--decode-steps", "2",
                          "--repeats", "1", "--copy-mib", "4", "--matmul-size", "64", "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    hosted = json.loads(out.read_text())["engine"]["host_experts"]
    assert hosted["expert_cache_slots"] == 4 and len(hosted["cache_hits"]) == 4
    assert all(0.0 <= r <= 1.0 for r in hosted["cache_hit_rate_by_layer"]) and sum(hosted["cache_misses"]) > 0
    assert hosted["device_expert_layers"] is None   # on the CPU: no device layers (one memory)
    assert "host experts: 0 MoE layers whole on the device, 4 cached per host layer, hit rate" in run.stdout


# -- the expert routing file ---------------------------------------------------------------------------------------

def _opts(**options) -> EngineOptions:
    return EngineOptions(device="cpu", dtype="float32", max_concurrency=4, max_context=256, prefill_chunk_size=16,
                         page_size=4, **options)


def test_routing_file_warms_the_cache_and_records_each_run(artifacts, tmp_path):
    import json

    path = tmp_path / "routing.json"
    plain = _generate(artifacts["top2of8"], host_experts=False)
    opts = dict(host_experts=True, expert_cache_slots=2, expert_routing_file=str(path))
    assert _generate(artifacts["top2of8"], **opts) == plain     # no file yet: written at close
    first = json.loads(path.read_text())
    assert first["format"] == "ninfer-expert-routing/1" and len(first["layers"]) == 4
    for layer in first["layers"]:   # top-2: two pairs a token, one call a step
        assert len(layer["counts"]) == 8 and sum(layer["counts"]) > 2 * layer["calls"] > 0
    with Engine.start(artifacts["top2of8"], _opts(**opts)) as engine:
        for cache, layer in zip(engine._program.model.expert_caches(), first["layers"], strict=True):  # noqa: SLF001
            best = sorted(range(8), key=lambda e: -layer["counts"][e])[:2]   # ties: the lower expert first
            assert sorted(cache.expert_in) == sorted(best) and cache.hits == 0
        handles = [engine.submit(p, sampling=GREEDY) for p in PROMPTS]
        assert [tuple(h.result().token_ids) for h in handles] == plain
        assert all(h > 0 for h in engine.stats().expert_cache_hits)
    second = json.loads(path.read_text())   # the file's counts plus the same run's again
    assert [[2 * n for n in layer["counts"]] for layer in first["layers"]] == [
        layer["counts"] for layer in second["layers"]]
    assert [2 * layer["calls"] for layer in first["layers"]] == [layer["calls"] for layer in second["layers"]]
    assert [p.name for p in tmp_path.iterdir()] == ["routing.json"]   # no temporary file left behind


@pytest.mark.parametrize("content,why", [
    ("{", "not JSON"),
    ('{"format": "other"}', "not an expert routing file"),
    ('{"format": "ninfer-expert-routing/1", "layers": {}}', "'layers' must be a list"),
    ('{"format": "ninfer-expert-routing/1", "layers": [{"calls": -1, "counts": []}]}', "layer 0 must be"),
    ('{"format": "ninfer-expert-routing/1", "layers": [{"calls": 1, "counts": [1, 2]}]}', "does not fit this model"),
])
def test_a_bad_routing_file_is_refused_at_start(artifacts, tmp_path, content, why):
    path = tmp_path / "routing.json"
    path.write_text(content)
    with pytest.raises(InvalidEngineOptions, match=why) as err:
        Engine.start(artifacts["top2of8"], _opts(host_experts=True, expert_cache_slots=2,
                                                 expert_routing_file=str(path)))
    assert str(path) in str(err.value)
    assert path.read_text() == content   # never overwritten by a failed start


def test_routing_file_options(artifacts, tmp_path, caplog):
    with pytest.raises(InvalidEngineOptions, match="needs host_experts"):
        EngineOptions(host_experts=False, expert_routing_file="r.json").validate()
    with pytest.raises(InvalidEngineOptions, match="file path"):
        EngineOptions(expert_routing_file="").validate()
    with pytest.raises(InvalidEngineOptions, match="does not exist"):
        Engine.start(artifacts["top2of8"], _opts(host_experts=True, expert_cache_slots=2,
                                                 expert_routing_file=str(tmp_path / "no" / "r.json")))
    path = tmp_path / "r.json"     # no cache: nothing to warm or record, and the engine says so
    with caplog.at_level("WARNING", logger="ninfer.engine.expert_routing"):
        with Engine.start(artifacts["top2of8"], _opts(host_experts=True, expert_cache_slots=0,
                                                      expert_routing_file=str(path))) as engine:
            engine.generate(PROMPTS[0], sampling=GREEDY)
    assert not path.exists() and "no device cache of host experts" in caplog.text
