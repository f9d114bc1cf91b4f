"""NInfer's own host-expert kernel (``host_expert_kernel="native"``, ``ninfer_qwen3_5/layers/host_native.py``).

Checked here: each projection against an fp64 oracle for every format it reads (fp32, bf16, q4_g64, q8_g32), at
row lengths with vector tails and quantization padding, at token counts that fill and leave partial token tiles;
the layer's sum against the fp64 oracle at Qwen3.5-MoE's top-8 of 256 and Qwen4-Exp's top-10 of 512 experts, with
no experts, all of them and some of them cached; greedy tokens of tiny MoE models equal to those without host
experts; the build (cached per source and CPU, a failing compiler named in the error).
"""

from __future__ import annotations

import types

import pytest
import torch
from ninfer import Engine, EngineOptions
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.errors import NotSupportedError
from ninfer.ops.reference.moe import moe_experts, routed_experts_fp32
from ninfer.ops.reference.quantized import DecodedBank
from ninfer.quant.packed import packed_view
from ninfer_qwen3_5.layers import host_native
from ninfer_qwen3_5.layers.host_compute import expert_groups, routed_sum
from ninfer_qwen3_5.layers.host_experts import HostExperts
from ninfer_qwen3_5.layers.host_native import NativeRows, bank_format, project
from ninfer_qwen3_5.layers.host_options import host_expert_options
from ops_triton.quant_cases import parent_bytes
from support.native import require_native_kernel

from engine.test_host_experts import MOES, _case, _fp64_moe, _generate, artifacts  # noqa: F401 (a fixture)


@pytest.fixture(scope="module", autouse=True)
def _built():
    """The kernel library, or a skip naming why it cannot be built on this host (no C compiler)."""
    require_native_kernel()


def _bank(fmt, experts, rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(experts, rows, k, generator=g) * 0.1
    if fmt in ("float32", "bfloat16"):
        return dense.to(getattr(torch, fmt))
    parent = parent_bytes(fmt, dense.reshape(-1, k))
    return packed_view(fmt, parent, tuple(dense.shape), 0, dense.numel(), tuple(dense.shape))


def _values(bank) -> torch.Tensor:
    return bank.dequantize(torch.float64) if not isinstance(bank, torch.Tensor) else bank.double()


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("k", [64, 200, 256])           # 200: a vector tail, and groupwise padding to 256
@pytest.mark.parametrize("counts", [[1], [4, 1, 7], [9, 2]])   # whole and partial 4-token tiles
@pytest.mark.parametrize("x_values", ["fp32", "bf16"])   # bf16 values: the bf16 dot products where the CPU has them
def test_a_projection_against_fp64(fmt, k, counts, x_values):
    """``y[p] = W_{e(p)} @ x[p]`` for pairs grouped by expert, rows not a multiple of the 16-row work item."""
    bank = _bank(fmt, experts=6, rows=37, k=k, seed=k)
    experts = [5, 0, 3][:len(counts)]
    groups = list(zip(experts, counts, strict=True))
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(1))
    if x_values == "bf16":
        x = x.bfloat16().float()
    got = project(x, bank, groups, threads=2)
    w = _values(bank)
    e_of_pair = torch.tensor([e for e, n in groups for _ in range(n)])
    want = torch.einsum("prk,pk->pr", w[e_of_pair], x.double())
    assert got.shape == (sum(counts), 37) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # Every pair reads its own expert (another expert's rows would be far off).
    assert not torch.allclose(got.double(), torch.einsum("prk,pk->pr", w[(e_of_pair + 1) % 6], x.double()),
                              atol=1e-3)


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16"])
def test_subnormal_scales_are_read_exactly(fmt):
    """Groups of tiny weights get fp16 subnormal scales (down to the smallest, 2^-24); the kernel's conversion of
    each row's scales keeps them exact."""
    dense = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3)) * 1e-7
    dense[:, :8] *= 1e5   # half the rows with normal scales beside them
    parent = parent_bytes(fmt, dense.reshape(-1, 64))
    bank = packed_view(fmt, parent, tuple(dense.shape), 0, dense.numel(), tuple(dense.shape))
    scales = bank.planes[2].float()
    assert bool(((scales > 0) & (scales < 2.0 ** -14)).any())   # subnormal fp16 scales are there
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    got = project(x, bank, [(1, 2), (0, 1)], threads=1)
    w = bank.dequantize(torch.float64)[[1, 1, 0]]
    want = torch.einsum("prk,pk->pr", w, x.double())
    tiny = want[:, 8:]
    assert torch.allclose(got[:, 8:].double(), tiny, rtol=1e-5, atol=1e-6 * tiny.abs().max().item())
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("fmt", ["bfloat16", "q4_g64_fp16", "q8_g32_fp16", "float32"])
@pytest.mark.parametrize("experts,k,tokens", [(256, 8, 1), (256, 8, 24), (512, 10, 1), (512, 10, 24)])
def test_the_native_sum_against_the_reference(fmt, experts, k, tokens):
    """routed_sum with the native kernel: the reference ``routed_experts_fp32`` within accumulation order (its
    fp32 sums) and the bank's roundings (bf16: each projection rounded, so a few last-place flips)."""
    x, w, ids, gate_up, down, _ = _case(torch.float32, experts=experts, k=k, tokens=tokens, hidden=64, inter=32)
    gate_up, down = _bank(fmt, experts, 64, 64, seed=1), _bank(fmt, experts, 64, 32, seed=2)
    if fmt == "bfloat16":
        x = x.bfloat16()
    banks = [b if isinstance(b, torch.Tensor) else DecodedBank(b) for b in (gate_up, down)]
    skip = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.3
    for skipped in (None, skip):
        want = routed_experts_fp32(x, w, ids, *banks, skip=skipped)
        got = routed_sum(x, w, ids, *banks, skip=skipped, rows=NativeRows(threads=2))
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < (1e-4 if fmt == "bfloat16" else 2e-6), rel
        if skipped is not None:   # a skipped pair's token gets nothing from it
            none = skipped.all(-1)
            assert not got[none].any()


@pytest.mark.parametrize("experts,k,tokens", [(256, 8, 1), (512, 10, 24)])
@pytest.mark.parametrize("slots,rounds", [("all", 0), ("all", 3), (3, 3)])
def test_the_native_layer_against_fp64_with_a_cache(experts, k, tokens, slots, rounds):
    """The layer with the native kernel on the host and none, all or some experts cached on the (CPU) device."""
    ops = types.SimpleNamespace(moe_experts=moe_experts)
    slots = experts if slots == "all" else slots
    x, w, ids, gate_up, down, shared = _case(torch.float32, experts=experts, k=k, tokens=tokens, hidden=32,
                                             inter=16, shared_inter=24)
    layer = HostExperts(gate_up, down, cache_slots=slots, ops=ops, device=torch.device("cpu"), dtype=torch.float32,
                        rows=NativeRows(threads=2))
    for _ in range(rounds):
        layer(x, w, ids, shared)
    got = layer(x, w, ids, shared)
    assert torch.allclose(got.double(), _fp64_moe(x, w, ids, gate_up, down, shared), rtol=1e-5, atol=1e-6)


def test_quantized_banks_are_read_as_stored(monkeypatch):
    """A q4 bank goes to the kernel as its packed planes (no expert is decoded), and a format the kernel has no
    code for (fp8 row) falls back to torch's GEMMs on the decoded experts."""
    q4, fp8 = _bank("q4_g64_fp16", 4, 32, 64, 0), _bank("fp8_e4m3fn_row_bf16", 4, 32, 64, 0)
    assert bank_format(q4) == "q4_g64_fp16" and bank_format(fp8) is None
    assert bank_format(torch.zeros(2, 3, 4, dtype=torch.float16)) is None
    assert not NativeRows.supports(q4, _bank("q8_g32_fp16", 4, 64, 16, 1))   # one format for both banks
    x, w, ids = torch.randn(3, 64), torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 3], [1, 2]])
    down8 = _bank("fp8_e4m3fn_row_bf16", 4, 64, 16, 1)
    fallback = routed_sum(x, w, ids, DecodedBank(fp8), DecodedBank(down8), rows=NativeRows(threads=1))
    assert torch.equal(fallback, routed_experts_fp32(x, w, ids, DecodedBank(fp8), DecodedBank(down8)))
    decoded = []
    real = DecodedBank.__getitem__
    monkeypatch.setattr(DecodedBank, "__getitem__", lambda self, e: decoded.append(e) or real(self, e))
    down4 = _bank("q4_g64_fp16", 4, 64, 16, 1)
    got = routed_sum(x, w, ids, DecodedBank(q4), DecodedBank(down4), rows=NativeRows(threads=1))
    assert decoded == []
    want = routed_experts_fp32(x, w, ids, DecodedBank(q4), DecodedBank(down4))
    assert decoded and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16", "fp8_e4m3fn_row_bf16"])
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_quantized_banks_are_cached_and_copied_as_stored(fmt, kernel):
    """With a quantized bank the device cache and the copy path hold experts as stored (for the device's quantized
    ``moe_experts``; here the CPU's reference), and the layer's result is the quantized reference's."""
    from ninfer.ops.reference.quantized import moe_experts as quantized_moe_experts
    from ninfer.quant import PackedWeight
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    ops = types.SimpleNamespace(moe_experts=quantized_moe_experts)
    x, w, ids, _, _, shared = _case(torch.float32, experts=8, k=3, tokens=9, hidden=64, inter=64)
    gate_up, down = _bank(fmt, 8, 128, 64, seed=1), _bank(fmt, 8, 64, 64, seed=2)
    stage = ExpertStage(torch.device("cpu"), torch.float32, slots=2)
    layer = HostExperts(gate_up, down, cache_slots=3, ops=ops, device=torch.device("cpu"), dtype=torch.float32,
                        copy_min_tokens=3, stage=stage, rows=NativeRows(threads=2) if kernel == "native" else None)
    want = quantized_moe_experts(x, w, ids, gate_up, down, shared=shared)
    for _ in range(3):
        got = layer(x, w, ids, shared)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    cache = layer.cache
    assert isinstance(cache.gate_up, PackedWeight) and cache.gate_up.format == fmt and cache.hits > 0
    staged = stage.buffers(gate_up, down)[0]
    assert isinstance(staged, PackedWeight) and staged.format == fmt and layer.copied_experts > 0
    for slot, expert in enumerate(cache.expert_in):   # each slot holds its expert's stored bytes
        if expert >= 0:
            assert all(torch.equal(a, b) for a, b in zip(cache.down[slot].planes, down[expert].planes, strict=True))


def test_a_dense_prefill_call_goes_to_torch_and_a_quantized_one_stays_native(monkeypatch):
    """Above NATIVE_DENSE_TOKENS tokens an expert a dense bank's call is torch's (bitwise the reference); a q4
    bank's stays with the native kernel whatever the count."""
    x, w, ids, gate_up, down, _ = _case(torch.float32, experts=4, k=2, tokens=12)   # 6 tokens an expert
    calls = []
    real, real_ids = NativeRows.add_routed, NativeRows.add_routed_ids
    monkeypatch.setattr(NativeRows, "add_routed", lambda self, *a: calls.append(len(a[1])) or real(self, *a))
    monkeypatch.setattr(NativeRows, "add_routed_ids",   # a decode-sized call: its pairs counted from ids
                        lambda self, *a: calls.append(a[3].numel()) or real_ids(self, *a))
    rows = NativeRows(threads=1)
    assert torch.equal(routed_sum(x, w, ids, gate_up, down, rows=rows), routed_experts_fp32(x, w, ids, gate_up, down))
    assert calls == []
    routed_sum(x[:4], w[:4], ids[:4], gate_up, down, rows=rows)   # 2 tokens an expert
    assert calls == [8]
    q4, dn4 = _bank("q4_g64_fp16", 4, 64, 64, 0), _bank("q4_g64_fp16", 4, 64, 32, 1)
    routed_sum(x, w, ids, DecodedBank(q4), DecodedBank(dn4), rows=rows)
    assert calls == [8, 24]


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16", "fp8_e4m3fn_row_bf16", None])
def test_the_cost_probe_times_a_bank_stored_as_the_models(fmt):
    """The start-up host timing reads a probe bank in the model's stored format (groupwise: packed planes the host
    layer reads as it reads the model's), else dense in the run dtype."""
    from ninfer.quant import encoded_size
    from ninfer_qwen3_5.layers.expert_costs import probe_bank

    gate_up = probe_bank(16, 64, 128, torch.bfloat16, fmt, pin=False)
    down = probe_bank(16, 128, 32, torch.bfloat16, fmt, pin=False)
    if fmt in ("q4_g64_fp16", "q8_g32_fp16"):
        assert isinstance(gate_up, DecodedBank) and gate_up.bank.format == fmt
        assert gate_up.bank.nbytes <= encoded_size(fmt, (16, 64, 128)) and bank_format(gate_up.bank) == fmt
    else:
        assert isinstance(gate_up, torch.Tensor) and gate_up.dtype == torch.bfloat16 and gate_up.shape == (16, 64, 128)
    x, w = torch.full((3, 128), 0.01, dtype=torch.bfloat16), torch.full((3, 8), 1.0 / 8)
    got = routed_sum(x, w, torch.arange(8).expand(3, 8), gate_up, down, rows=NativeRows(threads=1))
    assert got.shape == (3, 128) and bool(torch.isfinite(got).all()) and got.abs().sum() > 0


def test_a_large_call_runs_in_chunks_of_whole_groups_with_the_same_sum(monkeypatch):
    """Above CHUNK_PAIRS pairs the kernel runs on consecutive runs of whole groups (a larger group alone): the same
    pairs added in the same order, so the same sum bit for bit."""
    x, w, ids, _, _, _ = _case(torch.float32, experts=16, k=4, tokens=20, hidden=64, inter=32)
    gate_up, down = _bank("q8_g32_fp16", 16, 64, 64, seed=1), _bank("q8_g32_fp16", 16, 64, 32, seed=2)
    banks = [DecodedBank(gate_up), DecodedBank(down)]
    whole = routed_sum(x, w, ids, *banks, rows=NativeRows(threads=2))
    assert len(host_native._chunks([(0, 3), (1, 4), (2, 9), (3, 1)])) == 1
    monkeypatch.setattr(host_native, "CHUNK_PAIRS", 7)
    assert host_native._chunks([(0, 3), (1, 4), (2, 9), (3, 1)]) == [[(0, 3), (1, 4)], [(2, 9)], [(3, 1)]]
    chunked = routed_sum(x, w, ids, *banks, rows=NativeRows(threads=2))
    assert torch.equal(chunked, whole) and whole.abs().sum() > 0


def test_groups_give_each_expert_its_pairs():
    """expert_groups' (expert, count) order is the order of the sorted pairs the kernel's ``first`` offsets
    follow."""
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    order, groups = expert_groups(ids, None, 4)
    assert groups == [(0, 1), (1, 2), (2, 1), (3, 2)]
    assert ids.reshape(-1)[order].tolist() == [0, 1, 1, 2, 3, 3]


@pytest.mark.parametrize("name", list(MOES))
def test_greedy_tokens_equal_with_the_native_kernel(artifacts, name):  # noqa: F811 (the fixture)
    plain = _generate(artifacts[name], host_experts=False)
    assert _generate(artifacts[name], host_experts=True, host_expert_kernel="native") == plain


@pytest.fixture(scope="module")
def mixed(artifacts, tmp_path_factory):  # noqa: F811 (the fixture)
    """The top-2 of 8 model converted with the "mixed" recipe: experts q4, the rest q8."""
    from ninfer.conversion import convert

    source = artifacts["top2of8"].parent / "top2of8"
    return convert(source, tmp_path_factory.mktemp("mixed") / "m.ninfer", progress=False, quantize="mixed").paths[0]


def test_greedy_tokens_equal_with_quantized_host_experts(mixed):
    """The native kernel reading the q4 banks as stored gives the greedy tokens of the experts on the (CPU)
    device, and of torch's GEMMs."""
    plain = _generate(mixed, host_experts=False)
    assert _generate(mixed, host_experts=True, host_expert_kernel="native") == plain
    assert _generate(mixed, host_experts=True) == plain


def test_a_quantized_cache_slot_is_planned_as_stored(mixed, monkeypatch):
    """The planner prices a cache slot of a quantized bank at its byte-per-weight view, not the run dtype's."""
    import dataclasses

    from ninfer.planning import planner

    from engine.test_host_experts import _fake_gpu

    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=1, max_context=64, num_pages=16,
                         host_experts=True, device_expert_layers=0)
    _fake_gpu(monkeypatch, 1 << 40)
    none = planner.plan(mixed, dataclasses.replace(opts, expert_cache_slots=0))
    one = planner.plan(mixed, dataclasses.replace(opts, expert_cache_slots=1))
    assert one.model.profile.weight_bytes - none.model.profile.weight_bytes == 4 * 3 * 32 * 64   # a byte a weight


def test_calibration_prices_a_quantized_slot_as_stored(mixed, monkeypatch, tmp_path):
    """The slot size graph calibration drops slots by is what a slot of the q4 banks really holds (the storages of
    the Program's cache banks with one slot a layer), not the profile's byte a weight: dropping by a figure larger
    than the real one would free too little."""
    import dataclasses

    from ninfer.planning import planner

    from engine.test_host_experts import _fake_gpu

    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=1, max_context=64, num_pages=16,
                         host_experts=True, device_expert_layers=0)
    from ninfer.planning.calibration import tensor_storages

    with Engine.start(mixed, dataclasses.replace(opts, expert_cache_slots=1)) as engine:
        caches = engine._program.model.expert_caches()   # noqa: SLF001
        banks = sum(sum(tensor_storages([c.gate_up, c.down]).values()) for c in caches)
    _fake_gpu(monkeypatch, 1 << 40)
    record = tmp_path / "routing.json"   # the automatic cache needs a routing file (a plan does not read it)
    auto = planner.plan(mixed, dataclasses.replace(opts, expert_routing_file=str(record)))
    assert auto.memory.cache_slots == 8 and len(caches) == 4   # room for every expert; 4 MoE layers
    assert auto.memory.slot_bytes == banks
    # The profile's byte a weight differs (here it is less: these tiny rows are padded to 128 lanes when packed).
    one = planner.plan(mixed, dataclasses.replace(opts, expert_cache_slots=1)).model.profile.weight_bytes
    assert one - planner.plan(mixed, dataclasses.replace(opts, expert_cache_slots=0)).model.profile.weight_bytes \
        == 4 * 3 * 32 * 64 != banks


def test_options_select_the_native_kernel():
    features = EngineOptions(host_experts=True, host_expert_kernel="native").features()
    assert features.host_expert_kernel == "native"
    opts = host_expert_options(64, 32, 8, torch.device("cpu"), torch.float32, features)
    assert isinstance(opts["rows"], NativeRows) and opts["rows"].threads is None   # torch's count on the CPU


def test_auto_takes_the_native_kernel_on_a_gpu_run_and_torch_where_it_cannot(monkeypatch, caplog):
    # The default ("auto"): torch's GEMMs on the CPU (the reference op, bitwise); on a GPU run the native kernel,
    # or torch's with a warning that names why when this host cannot build it. host_expert_options reads only the
    # device's type before any CUDA work, so a "cuda" device object is enough to take the GPU branch here.
    from ninfer_qwen3_5.layers import host_options
    features = EngineOptions(host_experts=True).features()
    assert features.host_expert_kernel == "auto"
    assert host_options._auto_rows(torch.device("cpu"), None) is None
    require_native_kernel()
    assert isinstance(host_options._auto_rows(torch.device("cuda"), 2), NativeRows)

    def no_compiler():
        raise NotSupportedError("host_expert_kernel='native' needs a C compiler")

    monkeypatch.setattr(host_native, "library", no_compiler)
    with caplog.at_level("WARNING", logger="ninfer_qwen3_5.layers.host_options"):
        assert host_options._auto_rows(torch.device("cuda"), 2) is None
    assert "torch's GEMMs compute them instead" in caplog.text and "needs a C compiler" in caplog.text


def test_the_engine_reports_the_kernel_it_resolved(artifacts):  # noqa: F811 (the fixture)
    # Engine.info["host_expert_kernel"]: what the host computes with, "auto" resolved (torch on the CPU); None
    # without host experts; Engine.info["host_expert_threads"] with how many threads. ninfer bench's host-expert
    # summary reports the same.
    from ninfer import Engine
    opts = dict(device="cpu", dtype="float32", max_concurrency=2, max_context=64, page_size=4)
    with Engine.start(artifacts["top2of8"], EngineOptions(host_experts=True, **opts)) as engine:
        assert engine.info["host_expert_kernel"] == "torch"
        assert engine.info["host_expert_threads"] is None   # on the CPU torch's own count is kept
    with Engine.start(artifacts["top2of8"], EngineOptions(host_experts=True, host_expert_threads=1, **opts)) as engine:
        assert engine.info["host_expert_threads"] == 1
    with Engine.start(artifacts["top2of8"], EngineOptions(**opts)) as engine:
        assert engine.info["host_expert_kernel"] is None and engine.info["host_expert_threads"] is None
    require_native_kernel()
    with Engine.start(artifacts["top2of8"], EngineOptions(host_experts=True, host_expert_kernel="native",
                                                          **opts)) as engine:
        assert engine.info["host_expert_kernel"] == "native"


def test_the_build_is_cached_and_a_failing_compiler_is_named(tmp_path, monkeypatch):
    first = host_native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert host_native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp   # reused, not rebuilt
    monkeypatch.setenv("CC", "false")   # a compiler that always fails: another key, a build that fails
    with pytest.raises(NotSupportedError, match=r"host_expert_kernel='native'.*could not build"):
        host_native.build(tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(NotSupportedError, match="running the C compiler"):
        host_native.build(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]   # no partial library left behind


def test_the_row_prefetch_build_gives_the_same_bits(tmp_path, monkeypatch):
    """NINFER_HOST_ROW_PREFETCH builds the kernel with the bf16 reads prefetching that many rows ahead, or none (a build,
    cached under its own key): a prefetch moves no value, so the sums are the same bits, prefill- and decode-sized,
    and a value out of range is an error naming the variable."""
    x, w, ids, _, _, _ = _case(torch.float32, experts=16, k=4, tokens=24, hidden=64, inter=32)
    banks = _bank("bfloat16", 16, 64, 64, seed=1), _bank("bfloat16", 16, 64, 32, seed=2)
    sums, built, calls = [], set(), []
    for name in ("add_routed", "add_routed_ids"):   # both entries of the kernel, counted
        real = getattr(NativeRows, name)
        monkeypatch.setattr(NativeRows, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a))
    for rows in ("0", "4", "8"):
        monkeypatch.setenv(host_native.ROW_PREFETCH_ENV, rows)
        path = host_native.build(tmp_path)
        built.add(path.name)
        monkeypatch.setattr(host_native, "_library", host_native.load(path))
        native = NativeRows(threads=2)
        sums.append([routed_sum(x[:t].bfloat16(), w[:t], ids[:t], *banks, rows=native) for t in (1, 3, 8)])
    assert len(built) == 3
    assert calls == ["add_routed_ids", "add_routed_ids", "add_routed"] * 3
    for other in sums[1:]:
        assert all(torch.equal(a, b) for a, b in zip(sums[0], other, strict=True))
    for bad in ("2", "65", "-4", "many"):
        monkeypatch.setenv(host_native.ROW_PREFETCH_ENV, bad)
        with pytest.raises(InvalidEngineOptions, match=f"NINFER_HOST_ROW_PREFETCH={bad!r}"):
            host_native.build(tmp_path)
    monkeypatch.setattr(host_native, "_library", None)   # the next start builds, and reads the variable
    with pytest.raises(InvalidEngineOptions):   # stops "auto" too, instead of falling back to torch's kernel
        host_expert_options(64, 32, 16, torch.device("cuda"), torch.bfloat16,
                            StartupFeatures(host_experts=True, expert_copy_min_tokens=1, host_expert_kernel="auto"))


@pytest.mark.parametrize("fmt", ["bfloat16", "q4_g64_fp16", "q8_g32_fp16", "float32"])
def test_the_bf16_dot_build_against_the_fp32_one(tmp_path, monkeypatch, fmt):
    """NINFER_HOST_BF16_DOT=0 builds the kernel without the bf16 dot products. Inputs that are bf16 values (a bf16
    model's activations) take them where the CPU has them: both builds equal the reference within fp32 accumulation
    order, and the default build's bits differ from the other's (its sums run in another order: the dot products
    ran). Inputs that are not all bf16 values take the fp32 path in both builds, bit for bit. Row lengths with
    vector tails (hidden 200, inter 40) and partial token tiles; a value out of range is an error naming the
    variable."""
    experts, k, hidden, inter = 16, 4, 200, 40
    x, w, ids, _, _, _ = _case(torch.float32, experts=experts, k=k, tokens=7, hidden=hidden, inter=inter)
    stored = [_bank(fmt, experts, 2 * inter, hidden, seed=1), _bank(fmt, experts, hidden, inter, seed=2)]
    banks = [b if isinstance(b, torch.Tensor) else DecodedBank(b) for b in stored]
    inputs = {"bf16": x.bfloat16() if fmt == "bfloat16" else x.bfloat16().float(), "fp32": x}
    sums, dots = {}, {}
    for dot in ("0", "1"):
        monkeypatch.setenv(host_native.BF16_DOT_ENV, dot)
        monkeypatch.setattr(host_native, "_library", host_native.load(host_native.build(tmp_path)))
        dots[dot] = host_native.bf16_dot()
        for name, xs in inputs.items():
            for t in (1, 3, 7):   # decode-sized (sorted in the kernel) and larger calls
                sums[dot, name, t] = routed_sum(xs[:t], w[:t], ids[:t], *banks, rows=NativeRows(threads=2))
    assert not dots["0"] and len(list(tmp_path.iterdir())) == 2
    for t in (1, 3, 7):
        assert torch.equal(sums["0", "fp32", t], sums["1", "fp32", t])
        for dot in ("0", "1"):
            xs = inputs["bf16"]
            want = routed_experts_fp32(xs[:t], w[:t], ids[:t], *banks)
            rel = ((sums[dot, "bf16", t] - want).norm() / want.norm()).item()
            assert rel < (1e-4 if fmt == "bfloat16" else 2e-6), (dot, t, rel)
    if dots["1"] and fmt != "float32":   # an fp32 bank never takes them
        assert not all(torch.equal(sums["0", "bf16", t], sums["1", "bf16", t]) for t in (1, 3, 7))
    else:
        assert all(torch.equal(sums["0", "bf16", t], sums["1", "bf16", t]) for t in (1, 3, 7))
    monkeypatch.setenv(host_native.BF16_DOT_ENV, "2")
    with pytest.raises(InvalidEngineOptions, match="NINFER_HOST_BF16_DOT='2'"):
        host_native.build(tmp_path)


def test_a_library_that_does_not_load_is_named(tmp_path, monkeypatch):
    broken = tmp_path / "host_kernels-broken.so"
    broken.write_bytes(b"not a shared object")
    monkeypatch.setattr(host_native, "_library", None)
    monkeypatch.setattr(host_native, "build", lambda: broken)
    with pytest.raises(NotSupportedError, match=r"host-expert-kernel native.*does not load"):
        host_native.library()
    assert host_native._library is None   # nothing half-loaded kept


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("tokens", [1, 3, 4])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_decode_call_sorted_in_the_kernel_is_the_same_sum(fmt, tokens, x_dtype):
    """A decode-sized call goes to the kernel with the router's ids and weights as they are (``add_routed_ids``):
    the kernel sorts the pairs by expert as ``expert_groups`` does and widens x's rows as it gathers them, so the
    sum is the Python-sorted call's bit for bit, with and without skipped pairs, and an id outside the bank is named."""
    experts, k = 64, 8
    x, w, ids, _, _, _ = _case(torch.float32, experts=experts, k=k, tokens=tokens, hidden=64, inter=32)
    banks = [_bank(fmt, experts, 64, 64, seed=1), _bank(fmt, experts, 64, 32, seed=2)]
    stored = banks
    banks = [b if isinstance(b, torch.Tensor) else DecodedBank(b) for b in banks]
    x = x.to(x_dtype)
    rows = NativeRows(threads=2)
    wide = torch.promote_types(x.dtype, banks[0].dtype)
    skip = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) < 0.4
    for skipped in (None, skip, torch.ones_like(skip)):
        out = torch.zeros((tokens, 64))
        got = rows.add_routed_ids(out, x, w, ids, skipped, *stored, wide)
        want = torch.zeros((tokens, 64))
        order, groups = expert_groups(ids, skipped, experts)
        if groups:
            pair = order // k
            rows.add_routed(want, x.index_select(0, pair).to(wide), pair, w.reshape(-1)[order], groups, *stored, wide)
        assert torch.equal(got, want)
        assert torch.equal(routed_sum(x, w, ids, *banks, skip=skipped, rows=rows), want)
        assert skipped is not None or want.abs().sum() > 0
    assert got.abs().sum() == 0 and want.abs().sum() == 0   # every pair skipped: nothing added
    with pytest.raises(ValueError, match="expert id outside the bank"):
        rows.add_routed_ids(torch.zeros((tokens, 64)), x, w, ids + experts, None, *stored, wide)
