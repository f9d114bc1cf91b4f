"""Programmatic dependent launch (ninfer.ops.triton._common.pdl): where it is used, and that it changes no result.

On the GPU a decode-shaped chain of PDL kernels (norm -> GEMV -> router -> expert GEMVs -> add-norm -> GEMV, each
reading its predecessor's output) is captured in a CUDA graph with PDL on and replayed on fresh inputs; every
replay must equal, bit for bit, the same chain run eagerly with PDL off. A kernel that read its predecessor's
output before its wait would race and differ on some replay. The same for an attention decode layer and for a GDN
decode layer (norm -> input GEMV -> gdn_decode's one launch -> output GEMV, over evolving states; first run on the
H200 in the twelfth session) and for the head of a step (embedding + pre-norm -> rotary tables -> first GEMV).
"""

import pytest
import torch

pytest.importorskip("triton")

from .conftest import CUDA, DEVICE, triton_ops  # noqa: E402


def test_pdl_only_on_cuda_sm90_and_can_be_turned_off(monkeypatch):
    from ninfer.ops.triton import _common

    assert _common.pdl(torch.zeros(1)) == {"PDL": False}             # a CPU tensor: plain launch
    if CUDA:
        monkeypatch.setattr(_common, "PDL_ENABLED", False)
        assert _common.pdl(torch.zeros(1, device="cuda")) == {"PDL": False}


def _chain(ops, x, p):
    from ninfer.ops.contracts import SharedExpert

    e, s = p["experts"], p["shared"]
    h = ops.rms_norm_unit_offset(x, p["norm"], 1e-6)
    proj = ops.linear(h, p["w_in"])
    weights, ids = ops.moe_router(proj[:, :e], 8)
    shared = SharedExpert(projected=proj[:, e:e + 2 * s], down=p["sdown"], gate_logit=proj[:, e + 2 * s])
    out = ops.moe_experts(h, weights, ids, p["gate_up"], p["down"], shared=shared)
    y, _ = ops.add_rms_norm_unit_offset(out, x, p["norm"], 1e-6)
    return ops.linear(y, p["w_out"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA device of compute capability 9.0+")
@pytest.mark.parametrize("rows", [1, 4])
def test_pdl_graph_equals_plain_launches(monkeypatch, rows):
    from ninfer.ops.triton import _common

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    hdim, e, inter, s = 1024, 64, 256, 256

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(torch.bfloat16)

    p = dict(experts=e, shared=s, norm=rnd(hdim, scale=0.1), w_in=rnd(e + 2 * s + 1, hdim, scale=hdim ** -0.5),
             gate_up=rnd(e, 2 * inter, hdim, scale=hdim ** -0.5), down=rnd(e, hdim, inter, scale=inter ** -0.5),
             sdown=rnd(hdim, s, scale=s ** -0.5), w_out=rnd(hdim, hdim, scale=hdim ** -0.5))
    ops = triton_ops(torch.bfloat16)
    inputs = [rnd(rows, hdim) for _ in range(12)]
    monkeypatch.setattr(_common, "PDL_ENABLED", False)
    expected = [_chain(ops, x, p) for x in inputs]
    monkeypatch.setattr(_common, "PDL_ENABLED", True)
    assert _common.pdl(inputs[0]) == {"PDL": True, "launch_pdl": True}
    static = inputs[0].clone()
    _chain(ops, static, p)                                            # compile the PDL variants outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(ops, static, p)
    for x, want in zip(inputs, expected, strict=True):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def _attention_chain(ops, x, p, kv_lens, tables, slot_mapping, cos, sin):
    """A gated-attention decode layer: q/k/v/gate GEMVs, q/k norms + RoPE + KV write, split-K decode attention with
    the output gate (split and combine kernels), output GEMV, then greedy tokens of a small head."""
    b, hq, hkv, d = x.shape[0], p["hq"], p["hkv"], p["d"]
    q = ops.linear(x, p["wq"]).view(b, hq, d)
    k = ops.linear(x, p["wk"]).view(b, hkv, d)
    v = ops.linear(x, p["wv"]).view(b, hkv, d)
    gate = ops.linear(x, p["wg"])
    q, _ = ops.qk_norm_rope_cache(q, k, v, p["qn"], p["kn"], 1e-6, cos, sin, p["k_pool"], p["v_pool"], slot_mapping)
    o = ops.paged_decode_attention(q, p["k_pool"], p["v_pool"], kv_lens, tables, d ** -0.5, gate)
    y = ops.logits(ops.linear(o.reshape(b, hq * d), p["wo"]), p["head"])
    return y, ops.greedy_tokens(y)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA device of compute capability 9.0+")
@pytest.mark.parametrize("rows", [1, 3])
def test_pdl_attention_graph_equals_plain_launches(monkeypatch, rows):
    """The decode attention kernels (split and combine) and greedy_tokens under PDL, as above."""
    from ninfer.ops.triton import _common

    g = torch.Generator(device=DEVICE).manual_seed(10 + rows)
    hdim, hq, hkv, d, page, pages = 512, 8, 2, 256, 16, 40

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(torch.bfloat16)

    p = dict(hq=hq, hkv=hkv, d=d, wq=rnd(hq * d, hdim, scale=hdim ** -0.5), wk=rnd(hkv * d, hdim, scale=hdim ** -0.5),
             wv=rnd(hkv * d, hdim, scale=hdim ** -0.5), wg=rnd(hq * d, hdim, scale=hdim ** -0.5),
             qn=rnd(d, scale=0.1), kn=rnd(d, scale=0.1), wo=rnd(hdim, hq * d, scale=(hq * d) ** -0.5),
             head=rnd(5000, hdim, scale=hdim ** -0.5),
             k_pool=rnd(pages, page, hkv, d), v_pool=rnd(pages, page, hkv, d))
    ops = triton_ops(torch.bfloat16)
    # Row r decodes position 100 + 37 r over its own pages (several splits), writing its token's KV slot.
    kv_lens = torch.tensor([101 + 37 * r for r in range(rows)], dtype=torch.int32, device=DEVICE)
    tables = torch.stack([torch.arange(r * 12, r * 12 + 12, dtype=torch.int32, device=DEVICE) for r in range(rows)])
    slot_mapping = torch.tensor([(r * 12 + (100 + 37 * r) // page) * page + (100 + 37 * r) % page for r in range(rows)],
                                device=DEVICE)
    ang = torch.rand(rows, 64, device=DEVICE, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    inputs = [rnd(rows, hdim) for _ in range(8)]
    pools = (p["k_pool"].clone(), p["v_pool"].clone())
    args = (kv_lens, tables, slot_mapping, cos, sin)

    def reset():
        p["k_pool"].copy_(pools[0])
        p["v_pool"].copy_(pools[1])

    monkeypatch.setattr(_common, "PDL_ENABLED", False)
    expected = []
    for x in inputs:
        reset()
        expected.append(_attention_chain(ops, x, p, *args))
    monkeypatch.setattr(_common, "PDL_ENABLED", True)
    static = inputs[0].clone()
    reset()
    _attention_chain(ops, static, p, *args)                           # compile the PDL variants outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, tokens = _attention_chain(ops, static, p, *args)
    for x, (want, want_tokens) in zip(inputs, expected, strict=True):
        reset()
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(tokens, want_tokens)


def _gdn_chain(ops, x, p, conv_states, states, slots):
    """A GDN decode layer as the model runs it: pre-norm, the fused [mixed | z | b | a] projection GEMV (the launch
    before gdn_decode writes all four of its inputs), gdn_decode in one launch, the output GEMV."""
    prm, c = p["params"], p["c"]
    rows, hv, dv = x.shape[0], prm.value_heads, prm.value_dim
    proj = ops.linear(ops.rms_norm_unit_offset(x, p["norm"], 1e-6), p["w_in"])
    mixed, z = proj[:, :c], proj[:, c:c + hv * dv].view(rows, hv, dv)
    b, a = proj[:, c + hv * dv:c + hv * dv + hv], proj[:, c + hv * dv + hv:c + hv * dv + 2 * hv]
    o = ops.gdn_decode(mixed, z, a, b, prm, conv_states, states, slots)
    return ops.linear(o.reshape(rows, hv * dv), p["w_out"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA device of compute capability 9.0+")
@pytest.mark.parametrize("rows", [1, 3])
def test_pdl_gdn_graph_equals_plain_launches(monkeypatch, rows):
    """gdn_decode's one launch under PDL (its ticket taken and its states read before the wait) after the GEMV that
    writes its inputs, over 12 steps of evolving GDN and conv states: every output and the final states equal, bit
    for bit, the same chain run eagerly with PDL off. A read of the projection before the wait would race here."""
    from ninfer.ops.triton import _common
    from ninfer_qwen3_5.ops.contracts import GDNDecodeParams

    g = torch.Generator(device=DEVICE).manual_seed(20 + rows)
    hdim, hk, hv, dk, dv = 1024, 4, 8, 128, 128
    c = 2 * hk * dk + hv * dv

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(dtype)

    params = GDNDecodeParams(conv_weight=rnd(c, 4, scale=0.5),
                             neg_a=-torch.exp(rnd(hv, scale=0.5, dtype=torch.float32)),
                             dt_bias=rnd(hv, dtype=torch.float32), norm_weight=rnd(dv), key_heads=hk, key_dim=dk,
                             value_heads=hv, value_dim=dv, eps=1e-6, scale=dk ** -0.5)
    p = dict(params=params, c=c, norm=rnd(hdim, scale=0.1), w_in=rnd(c + hv * dv + 2 * hv, hdim, scale=hdim ** -0.5),
             w_out=rnd(hdim, hv * dv, scale=(hv * dv) ** -0.5))
    conv0, states0 = rnd(rows + 2, c, 3), rnd(rows + 2, hv, dk, dv, scale=0.1, dtype=torch.float32)
    slots = torch.randperm(rows + 2, generator=torch.Generator().manual_seed(rows))[:rows].to(DEVICE)
    ops = triton_ops(torch.bfloat16)
    inputs = [rnd(rows, hdim) for _ in range(12)]
    monkeypatch.setattr(_common, "PDL_ENABLED", False)
    conv_e, states_e = conv0.clone(), states0.clone()
    expected = [_gdn_chain(ops, x, p, conv_e, states_e, slots) for x in inputs]
    monkeypatch.setattr(_common, "PDL_ENABLED", True)
    static = inputs[0].clone()
    _gdn_chain(ops, static, p, conv0.clone(), states0.clone(), slots)    # compile the PDL variants outside capture
    torch.cuda.synchronize()
    conv_g, states_g = conv0.clone(), states0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _gdn_chain(ops, static, p, conv_g, states_g, slots)
    for step, (x, want) in enumerate(zip(inputs, expected, strict=True)):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"step {step}"
    assert torch.equal(conv_g, conv_e) and torch.equal(states_g, states_e)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA device of compute capability 9.0+")
def test_pdl_step_head_graph_equals_plain_launches(monkeypatch):
    """The head of a decode step as the model launches it (twelfth session): embed_rms_norm_unit_offset (the first kernel),
    mrope_cos_sin (its tables computed before its wait, stored after), the first GEMV; replayed under PDL on
    fresh tokens and positions, equal bit for bit to plain launches."""
    from ninfer.ops.triton import _common

    g = torch.Generator(device=DEVICE).manual_seed(9)
    vocab, hdim, half = 5000, 1024, 32
    table = (torch.randn(vocab, hdim, device=DEVICE, generator=g)).to(torch.bfloat16)
    norm = (torch.randn(hdim, device=DEVICE, generator=g) * 0.1).to(torch.bfloat16)
    w = (torch.randn(3000, hdim, device=DEVICE, generator=g) * hdim ** -0.5).to(torch.bfloat16)
    inv = 1.0 / (1e7 ** (torch.arange(0, 2 * half, 2, device=DEVICE).float() / (2 * half)))
    ops = triton_ops(torch.bfloat16)

    def head(tokens, positions):
        h, rows = ops.embed_rms_norm_unit_offset(tokens, table, norm, 1e-6)
        cos, sin = ops.mrope_cos_sin(positions.unsqueeze(0).expand(3, -1), inv, (11, 11, 10), True)
        return ops.linear(h, w), rows, cos, sin

    steps = [(torch.randint(0, vocab, (1,), device=DEVICE, generator=g),
              torch.randint(0, 200_000, (1,), device=DEVICE, generator=g)) for _ in range(12)]
    monkeypatch.setattr(_common, "PDL_ENABLED", False)
    expected = [head(t, p) for t, p in steps]
    monkeypatch.setattr(_common, "PDL_ENABLED", True)
    tokens, positions = steps[0][0].clone(), steps[0][1].clone()
    head(tokens, positions)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = head(tokens, positions)
    for (t, p), want in zip(steps, expected, strict=True):
        tokens.copy_(t)
        positions.copy_(p)
        graph.replay()
        torch.cuda.synchronize()
        for got, exp in zip(outs, want, strict=True):
            assert torch.equal(got, exp)
