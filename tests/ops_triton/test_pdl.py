"""Programmatic dependent launch (ninfer.ops.triton._common.pdl): where it is used, and that it changes no result.

On the GPU a decode-shaped chain of PDL kernels (norm -> GEMV -> router -> expert GEMVs -> add-norm -> GEMV, each
reading its predecessor's output) is captured in a CUDA graph with PDL on and replayed on fresh inputs; every
replay must equal, bit for bit, the same chain run eagerly with PDL off. A kernel that read its predecessor's
output before its wait would race and differ on some replay.
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
    h = ops.rms_norm(x, p["norm"], 1e-6)
    proj = ops.linear(h, p["w_in"])
    weights, ids = ops.moe_router(proj[:, :e], 8)
    shared = SharedExpert(projected=proj[:, e:e + 2 * s], down=p["sdown"], gate_logit=proj[:, e + 2 * s])
    out = ops.moe_experts(h, weights, ids, p["gate_up"], p["down"], shared=shared)
    y, _ = ops.add_rms_norm(out, x, p["norm"], 1e-6)
    return ops.linear(y, p["w_out"])


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
