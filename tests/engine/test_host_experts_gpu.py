"""Host experts on CUDA (docs/memory.md, "Host experts"): the routed sum crosses the PCIe bus, cached and copied
experts run the device's Triton ``moe_experts``.

- the layer: uncached, cached and copied experts, fp32 and bf16 activations, within the rounding of an fp64 oracle;
- the engine: the tiny top-2 of 8 MoE model in fp32 gives the device-resident model's greedy tokens (also through
  DFlash verify graphs captured around the host steps) and, within fp32 summation order, its scoring logprobs,
  with the default cache and copy threshold, a forced copy path, the measured cost model balancing copies against
  the host, and the compiled host kernel; the measured costs are in a plausible range; the cache sees hits.
"""

from __future__ import annotations

import pytest
import torch
from ninfer import Engine, EngineOptions

from .test_host_experts import GREEDY, PROMPTS, _case, _fp64_moe, artifacts  # noqa: F401 (the fixture)

pytestmark = pytest.mark.gpu


def _cuda_ops(dtype):
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    return resolve_ops(get_registry().ops, "cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache,copy", [(0, None), (4, None), (0, 1), (3, 2), (0, "costs"), (3, "costs")])
def test_cuda_host_experts_against_fp64(dtype, cache, copy):
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_experts import ExpertStage, HostExperts

    dev = torch.device("cuda")
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=16, k=4, tokens=11, hidden=64, inter=32)
    want = _fp64_moe(x.to(dtype).float(), w, ids, gate_up.to(dtype).float(), down.to(dtype).float(),
                     type(shared)(shared.projected.to(dtype).float(), shared.down.to(dtype).float(),
                                  shared.gate_logit))
    stage = ExpertStage(dev, dtype, slots=2) if copy else None
    layer = HostExperts(gate_up.to(dtype), down.to(dtype), cache_slots=cache, ops=_cuda_ops(dtype), device=dev,
                        dtype=dtype, stage=stage, threads=torch.get_num_threads(),
                        **({"costs": ExpertCosts(1.0, 1.0, 0.5)} if copy == "costs" else {"copy_min_tokens": copy}))
    dshared = type(shared)(shared.projected.to(dtype).to(dev), shared.down.to(dtype).to(dev),
                           shared.gate_logit.to(dev))
    for _ in range(3):   # the cache (if any) fills from the routing it sees
        got = layer(x.to(dtype).to(dev), w.to(dev), ids.to(dev), dshared)
    assert got.device.type == "cuda" and got.dtype == dtype
    err = (got.double().cpu() - want).norm() / want.norm()
    assert err < (2e-6 if dtype == torch.float32 else 1.5e-2), err
    if cache:   # refreshed on a side stream after each call (ExpertCache.refresh_behind), unless the copy path's
        # admissions filled it and every refresh found it settled
        assert layer.cache.hits > 0 and layer.cache.copies > 0
        assert layer.cache._side is not None or copy  # noqa: SLF001
    if copy:
        assert layer.copied_experts > 0


def _cuda_generate(path, **options):
    # Every layer on the host unless a test asks otherwise: the tiny models fit the device whole, so the automatic
    # count would keep all but one layer's experts there.
    options.setdefault("device_expert_layers", 0)
    opts = EngineOptions(device="cuda", dtype="float32", max_concurrency=4, max_context=256, prefill_chunk_size=16,
                         page_size=4, **options)
    with Engine.start(path, opts) as engine:
        handles = [engine.submit(p, sampling=GREEDY) for p in PROMPTS]
        tokens = [tuple(h.result().token_ids) for h in handles]
        return tokens, engine.stats(), engine.memory_summary()


def _cuda_logprobs(path, **options):
    options.setdefault("device_expert_layers", 0)
    with Engine.start(path, device="cuda", dtype="float32", purpose="causal_scoring", **options) as engine:
        return [t.logprob for t in engine.score([PROMPTS[3]], logprobs=True).texts[0].token_logprobs]


def test_cuda_engine_with_host_experts_equals_device_experts(artifacts):  # noqa: F811
    path = artifacts["top2of8"]
    plain, _, _ = _cuda_generate(path, host_experts=False)
    bare, stats, memory = _cuda_generate(path, host_experts=True)
    assert bare == plain and all(len(t) == 24 for t in plain)
    assert memory.graph_final_growth_bytes > 0   # decode graphs, in segments around the host steps
    assert memory.host_weights_bytes > 0
    assert len(stats.expert_cache_hits) == 0   # no routing record: the automatic cache stays empty
    hosted, stats, _ = _cuda_generate(path, host_experts=True, expert_cache_slots=4)
    assert hosted == plain
    assert len(stats.expert_cache_hits) == 4 and all(h > 0 for h in stats.expert_cache_hits)
    copied, _, _ = _cuda_generate(path, host_experts=True, expert_cache_slots=0, expert_copy_min_tokens=1)
    assert copied == plain
    balanced, _, _ = _cuda_generate(path, host_experts=True, expert_cache_slots=0, host_expert_threads=2)
    assert balanced == plain


def test_cuda_engine_with_the_compiled_host_kernel_equals_device_experts(artifacts):  # noqa: F811
    path = artifacts["top2of8"]
    plain, _, _ = _cuda_generate(path, host_experts=False)
    compiled, _, _ = _cuda_generate(path, host_experts=True, host_expert_kernel="compiled")
    assert compiled == plain


def test_cuda_engine_with_the_native_host_kernel_equals_device_experts(artifacts):  # noqa: F811
    """The native kernel in a CUDA engine (decode graphs in segments around it), every expert on the host, and with
    the cache and the copy path: the greedy tokens of the experts on the device."""
    path = artifacts["top2of8"]
    plain, _, _ = _cuda_generate(path, host_experts=False)
    native, _, _ = _cuda_generate(path, host_experts=True, host_expert_kernel="native", expert_cache_slots=0,
                                  expert_copy_min_tokens=10**6)
    assert native == plain
    mixed, _, _ = _cuda_generate(path, host_experts=True, host_expert_kernel="native", expert_cache_slots=3,
                                 expert_copy_min_tokens=3)
    assert mixed == plain


def test_cuda_quantized_experts_cached_and_copied_packed(artifacts, tmp_path):  # noqa: F811
    """A "mixed" artifact (experts q4): the cache's slots and the copy path's stage hold packed experts that the
    device's quantized moe_experts reads; greedy tokens equal the experts on the device, with either host kernel."""
    from ninfer.conversion import convert

    source = artifacts["top2of8"].parent / "top2of8"
    mixed = convert(source, tmp_path / "mixed.ninfer", progress=False, quantize="mixed").paths[0]
    plain, _, _ = _cuda_generate(mixed, host_experts=False)
    for kernel in ("torch", "native"):
        got, stats, _ = _cuda_generate(mixed, host_experts=True, host_expert_kernel=kernel, expert_cache_slots=3,
                                       expert_copy_min_tokens=3)
        assert got == plain and all(h > 0 for h in stats.expert_cache_hits)


def test_cuda_scoring_with_host_experts_equals_device_experts(artifacts):  # noqa: F811
    path = artifacts["top2of8"]
    want = torch.tensor(_cuda_logprobs(path, host_experts=False))
    got = torch.tensor(_cuda_logprobs(path, host_experts=True, expert_cache_slots=0))
    assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()


def test_cuda_expert_costs_are_measured():
    from ninfer_qwen3_5.layers.expert_costs import measure_expert_costs

    costs = measure_expert_costs(2048, 512, torch.device("cuda"), torch.bfloat16, threads=4)
    # A single-token expert on the host reads all its weights: not faster than 1 TB/s, not slower than 100 MB/s.
    expert_bytes = 3 * 2048 * 512 * 2
    assert expert_bytes / 1e12 < costs.host_s < expert_bytes / 1e8, costs
    assert expert_bytes / 1e12 < costs.copy_s < expert_bytes / 1e8, costs


def test_cuda_speculative_verify_graphs_through_host_experts(artifacts, tmp_path):  # noqa: F811
    """A DFlash drafter on a host-expert MoE target on CUDA: the verify graphs (k + 1 rows a request) are captured
    in segments around the host steps, and the greedy tokens stay plain decoding's."""
    from ninfer.conversion import convert
    from support.dflash import write_dflash_drafter

    folder = write_dflash_drafter(tmp_path / "drafter", seed=3, hidden_size=64, vocab_size=512, num_target_layers=4,
                                  target_layer_ids=[1, 2], block_size=4, mask_token_id=511, head_dim=16, heads=4,
                                  kv_heads=2, intermediate=64, generation=1)
    source = artifacts["top2of8"].with_suffix("")   # the checkpoint folder the fixture converted
    art = convert(source, tmp_path / "with_drafter.ninfer", progress=False, draft=folder).paths[0]
    plain, _, _ = _cuda_generate(artifacts["top2of8"], host_experts=False)
    got, _, memory = _cuda_generate(art, host_experts=True, speculative="dflash", num_speculative_tokens=3)
    assert got == plain
    assert memory.graph_final_growth_bytes > 0



def test_cuda_moe_prefill_graphs_equal_eager(artifacts):  # noqa: F811
    """The flat prefill-step graphs over a MoE model (device experts: the grouped expert GEMMs inside the graph) give
    the eager tokens; with host experts none are captured."""
    path = artifacts["top2of8"]
    plain, _, _ = _cuda_generate(path, host_experts=False, prefill_graphs=False)
    with Engine.start(path, EngineOptions(device="cuda", dtype="float32", max_concurrency=4, max_context=256,
                                          prefill_chunk_size=16, page_size=4, host_experts=False,
                                          prefill_graphs=True)) as engine:
        assert engine.info["prefill_graphs"] == [16]
        handles = [engine.submit(p, sampling=GREEDY) for p in PROMPTS]
        assert [tuple(h.result().token_ids) for h in handles] == plain
        assert engine._program.prefill_graphs.replays > 0  # noqa: SLF001
    with Engine.start(path, EngineOptions(device="cuda", dtype="float32", max_concurrency=4, max_context=256,
                                          page_size=4, host_experts=True, prefill_graphs=True)) as engine:
        assert engine.info["prefill_graphs"] == []


def test_cuda_whole_device_layers_and_a_host_embedding_keep_the_tokens(artifacts):  # noqa: F811
    """With host experts the input embedding is read from page-locked host memory, and whole layers may keep their
    experts on the device: the automatic count (the default budget holds every layer, so all but one) and an
    explicit one give the device-resident model's greedy tokens; only the host layers have caches."""
    path = artifacts["top2of8"]
    plain, _, _ = _cuda_generate(path, host_experts=False)
    auto, stats, memory = _cuda_generate(path, host_experts=True, device_expert_layers=None)
    assert auto == plain
    # layers 0-2 whole on the device, layer 3's experts on the host (no routing record: no cache)
    assert len(stats.expert_cache_hits) == 0
    assert memory.host_weights_bytes > 0
    two, stats, _ = _cuda_generate(path, host_experts=True, device_expert_layers=2, expert_cache_slots=1)
    assert two == plain and len(stats.expert_cache_hits) == 2
    with Engine.start(path, EngineOptions(device="cuda", dtype="float32", max_concurrency=1, max_context=64,
                                          host_experts=True, device_expert_layers=1)) as engine:
        embed = engine._program.model.embed   # noqa: SLF001
        assert embed.device.type == "cpu" and embed.is_pinned()
        assert engine.options.device_expert_layers == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,bus_s", [(1, 1.0), (3, 1.0), (1, 0.01)])
def test_cuda_bus_reads_against_fp64(dtype, tokens, bus_s):
    """The device's moe_experts reading page-locked host banks in place (the last choices of each token) beside the
    host's share: the fp64 oracle's sum within the dtype's rounding."""
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_experts import ExpertStage, HostExperts

    dev = torch.device("cuda")
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=16, k=4, tokens=tokens, hidden=64, inter=32)
    want = _fp64_moe(x.to(dtype).float(), w, ids, gate_up.to(dtype).float(), down.to(dtype).float(),
                     type(shared)(shared.projected.to(dtype).float(), shared.down.to(dtype).float(),
                                  shared.gate_logit))
    costs = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=bus_s)
    layer = HostExperts(gate_up.to(dtype).pin_memory(), down.to(dtype).pin_memory(), ops=_cuda_ops(dtype),
                        device=dev, dtype=dtype, costs=costs, stage=ExpertStage(dev, dtype, slots=2),
                        threads=torch.get_num_threads())
    dshared = type(shared)(shared.projected.to(dtype).to(dev), shared.down.to(dtype).to(dev),
                           shared.gate_logit.to(dev))
    got = layer(x.to(dtype).to(dev), w.to(dev), ids.to(dev), dshared)
    assert layer.bus_pairs == tokens * costs.bus_ranks(4) > 0
    err = (got.double().cpu() - want).norm() / want.norm()
    assert err < (2e-6 if dtype == torch.float32 else 1.5e-2), err
    unpinned = HostExperts(gate_up.to(dtype), down.to(dtype), ops=_cuda_ops(dtype), device=dev, dtype=dtype,
                           costs=costs, stage=ExpertStage(dev, dtype, slots=2))
    assert not unpinned._bus   # noqa: SLF001 (pageable memory: the device cannot read it in place)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    stored_other = HostExperts(gate_up.to(other).pin_memory(), down.to(other).pin_memory(), ops=_cuda_ops(dtype),
                               device=dev, dtype=dtype, costs=costs, stage=ExpertStage(dev, dtype, slots=2))
    assert not stored_other._bus   # noqa: SLF001 (the device's op would convert the bank to the run dtype)
    got = stored_other(x.to(dtype).to(dev), w.to(dev), ids.to(dev), dshared)   # the copy path and the host
    assert got.dtype == dtype and stored_other.bus_pairs == 0


def test_cuda_bus_seconds_are_measured():
    from ninfer_qwen3_5.layers.expert_costs import measure_expert_costs

    dev = torch.device("cuda")
    costs = measure_expert_costs(2048, 512, dev, torch.bfloat16, threads=4,
                                 bus=_cuda_ops(torch.bfloat16).moe_experts)
    # A pair reads its expert's weights over the bus: not faster than 1 TB/s, not slower than 100 MB/s.
    expert_bytes = 3 * 2048 * 512 * 2
    assert expert_bytes / 1e12 < costs.bus_s < expert_bytes / 1e8, costs
    quantized = measure_expert_costs(2048, 512, dev, torch.bfloat16, threads=4, stored_format="q4_g64_fp16",
                                     stored_bytes=expert_bytes // 4, bus=_cuda_ops(torch.bfloat16).moe_experts)
    assert quantized.bus_s is None   # read as stored by the host only


def test_cuda_engine_with_bus_reads_equals_device_experts(artifacts, monkeypatch):  # noqa: F811
    """Bus reads in a CUDA engine (decode graphs in segments around the host steps), forced on by the costs: the
    greedy tokens of the experts on the device."""
    from ninfer_qwen3_5.layers import host_experts as he
    from ninfer_qwen3_5.layers import host_options
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts

    path = artifacts["top2of8"]
    plain, _, _ = _cuda_generate(path, host_experts=False)
    used = []
    real = he.HostExperts._bus_call

    def counted(self, *args):
        used.append(args[-1])
        return real(self, *args)

    monkeypatch.setattr(host_options, "measure_expert_costs",
                        lambda *a, **k: ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=1.0))
    monkeypatch.setattr(he.HostExperts, "_bus_call", counted)
    for kernel in ("torch", "native"):
        got, _, _ = _cuda_generate(path, host_experts=True, host_expert_kernel=kernel)
        assert got == plain
    assert used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "q4_g64_fp16"])
def test_cuda_host_calls_equal_the_host_step(dtype, fmt):
    """A host call (the mailbox kernels and the native kernel as a host function on the stream) gives the eager
    native host step's bits, eagerly and replayed from a CUDA graph with new inputs each time; both within the
    fp64 oracle's rounding."""
    from ninfer.quant.packed import packed_view
    from ninfer_qwen3_5.layers.host_experts import HostExperts
    from ninfer_qwen3_5.layers.host_native import NativeRows
    from ops_triton.quant_cases import parent_bytes

    dev = torch.device("cuda")
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=16, k=4, tokens=3, hidden=64, inter=32)
    banks = [b.to(dtype).pin_memory() for b in (gate_up, down)]
    if fmt != "dense":
        banks = [packed_view(fmt, parent_bytes(fmt, b.reshape(-1, b.shape[-1])), tuple(b.shape), 0, b.numel(),
                             tuple(b.shape)) for b in (gate_up, down)]
    kw = dict(device=dev, dtype=dtype, threads=4, rows=NativeRows(4), top_k=4)
    eager, mailed = HostExperts(*banks, **kw), HostExperts(*banks, host_calls=True, **kw)
    assert mailed.mailbox is not None
    dshared = type(shared)(shared.projected.to(dtype).to(dev), shared.down.to(dtype).to(dev),
                           shared.gate_logit.to(dev))
    xd, wd, idsd = x.to(dtype).to(dev), w.to(dev), ids.to(dev)
    want = eager(xd, wd, idsd, dshared)
    assert torch.equal(mailed(xd, wd, idsd, dshared), want)
    if fmt == "dense":
        oracle = _fp64_moe(x.to(dtype).float(), w, ids, gate_up.to(dtype).float(), down.to(dtype).float(),
                           type(shared)(shared.projected.to(dtype).float(), shared.down.to(dtype).float(),
                                        shared.gate_logit))
        err = (want.double().cpu() - oracle).norm() / oracle.norm()
        assert err < (2e-6 if dtype == torch.float32 else 1.5e-2), err
    _replays_equal_eager(mailed, eager, (xd, wd, idsd, dshared), dtype, seed=5)
    mailed.mailbox.check()


def test_cuda_engine_with_host_calls_equals_device_experts(artifacts, monkeypatch):  # noqa: F811
    """NINFER_HOST_CALLS=1 in a CUDA engine, every layer's experts on the host with the native kernel: the greedy
    tokens of the experts on the device, each decode graph captured whole (no host step cuts it), in fp32 and with
    the bf16 scoring path's logprobs within fp32 summation order. Bus reads are off: the start-up's cost model may
    send every choice of a decode step over the bus, and then a layer makes no host call at all."""
    from ninfer_qwen3_5.layers.host_options import BUS_READS_ENV, HOST_CALLS_ENV

    path = artifacts["top2of8"]
    plain, _, _ = _cuda_generate(path, host_experts=False)
    monkeypatch.setenv(HOST_CALLS_ENV, "1")
    monkeypatch.setenv(BUS_READS_ENV, "0")
    got, _, memory = _cuda_generate(path, host_experts=True, host_expert_kernel="native")
    assert got == plain and memory.graph_final_growth_bytes > 0
    opts = EngineOptions(device="cuda", dtype="float32", max_concurrency=4, max_context=256, prefill_chunk_size=16,
                         page_size=4, host_experts=True, host_expert_kernel="native", device_expert_layers=0)
    with Engine.start(path, opts) as engine:
        handles = [engine.submit(p, sampling=GREEDY) for p in PROMPTS]
        assert [tuple(h.result().token_ids) for h in handles] == plain
        program = engine._program   # noqa: SLF001
        hosts = [layer.mlp.host for layer in program.model.layers if getattr(layer.mlp, "host", None) is not None]
        assert hosts and all(h.mailbox is not None and h.mailbox.calls > 0 for h in hosts)
        segments = [len(graph.graphs) for graph, _ in program.graphs._graphs.values()]  # noqa: SLF001
        assert segments and set(segments) == {1}
    want = torch.tensor(_cuda_logprobs(path, host_experts=False))
    got = torch.tensor(_cuda_logprobs(path, host_experts=True, expert_cache_slots=0, host_expert_kernel="native"))
    assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bus_reads_beside_a_host_call(dtype):
    """Bus reads on a side stream while the host function runs: the host step's bus call's bits, eagerly and from a
    replayed CUDA graph (a fork and join inside the capture)."""
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_experts import ExpertStage, HostExperts
    from ninfer_qwen3_5.layers.host_native import NativeRows

    dev = torch.device("cuda")
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=16, k=4, tokens=2, hidden=64, inter=32)
    banks = [b.to(dtype).pin_memory() for b in (gate_up, down)]
    costs = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=1.0)
    kw = dict(ops=_cuda_ops(dtype), device=dev, dtype=dtype, costs=costs, stage=ExpertStage(dev, dtype, slots=2),
              threads=4, rows=NativeRows(4), top_k=4)
    eager, mailed = HostExperts(*banks, **kw), HostExperts(*banks, host_calls=True, **kw)
    assert mailed.mailbox is not None and mailed._side is not None  # noqa: SLF001
    dshared = type(shared)(shared.projected.to(dtype).to(dev), shared.down.to(dtype).to(dev),
                           shared.gate_logit.to(dev))
    xd, wd, idsd = x.to(dtype).to(dev), w.to(dev), ids.to(dev)
    want = eager(xd, wd, idsd, dshared)
    assert torch.equal(mailed(xd, wd, idsd, dshared), want)
    assert mailed.bus_pairs == 2 * costs.bus_ranks(4) > 0
    _replays_equal_eager(mailed, eager, (xd, wd, idsd, dshared), dtype, seed=9)


def _replays_equal_eager(mailed, eager, args, dtype, seed):
    """``mailed``'s call captured in a CUDA graph (after one warm call outside it), replayed with three new sets of
    inputs written into the captured ones: each replay's output is ``eager``'s on those inputs, bit for bit."""
    xd, wd, idsd, dshared = args
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mailed(*args)   # warm: kernels compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mailed(*args)
    for s in range(seed, seed + 3):
        xn, wn, idsn, _, _, _ = _case(torch.float32, experts=16, k=4, tokens=xd.shape[0], hidden=64, inter=32, seed=s)
        xd.copy_(xn.to(dtype))
        wd.copy_(wn)
        idsd.copy_(idsn)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager(*args)), s
