"""The stream-K q4 decode GEMV (``ninfer.ops.triton.quant_gemv_streamk``, ``NINFER_QUANT_SPLIT=streamk``).

Where its shares coincide with the row-block kernel's K runs (every block split into the same runs) the partials
are the same sums added in the same order, so the outputs equal :func:`quant_gemv_tc.gemv_tc`'s bit for bit, norm
and SwiGLU included; uneven shares (one program spanning two row blocks, blocks with different contributor
counts) stay within the tensor-core bound of the fp64 oracle. The ticket counters are zero after every launch,
and the contributor bound that sizes the partials holds for every share layout. Runs on CUDA when present,
otherwise under TRITON_INTERPRET=1 at tiny sizes."""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE  # noqa: E402
from .quant_cases import U_TC, assert_dot_bound, random_packed  # noqa: E402

Q4 = "q4_g64_fp16"


def _kw(w):
    from ninfer.ops.triton._quant import kernel_weight

    return kernel_weight(w, "t")


def _norm_args(gen, m, k):
    res = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, k, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    return res, nw


def _counters_zero():
    from ninfer.ops.triton._splitk import tickets

    return int(tickets(torch.device(DEVICE), 1).abs().sum()) == 0


def _owners(blocks: int, steps: int, programs: int) -> list[list[int]]:
    """Each block's contributing programs, by walking every program's share."""
    units = blocks * steps
    per = [[] for _ in range(blocks)]
    for p in range(programs):
        for u in range(p * units // programs, (p + 1) * units // programs):
            if p not in per[u // steps]:
                per[u // steps].append(p)
    return per


def test_the_contributor_bound_holds_for_every_share_layout():
    from ninfer.ops.triton.quant_gemv_streamk import contributors, shares

    for blocks in range(1, 13):
        for steps in range(1, 17):
            for slots in range(1, 40):
                programs = shares(blocks, steps, slots)
                per = _owners(blocks, steps, programs)
                assert all(per), (blocks, steps, programs)                 # every block has a contributor
                assert max(len(c) for c in per) <= contributors(blocks, steps, programs)
                # ranks are p - first owner: consecutive programs, as the kernel assumes
                assert all(c == list(range(c[0], c[0] + len(c))) for c in per)
    assert shares(3, 4, 1000) == 12 and shares(97, 8, 264) == 264


@pytest.mark.parametrize("variant", ["plain", "norm", "norm_swiglu"])
def test_even_shares_equal_the_row_block_kernel_bit_for_bit(variant, gen):
    """3 row blocks (256 with SwiGLU's halves: 2 + 2) of 4 K steps over twice as many programs as blocks: every
    block in 2 runs of 2 steps, as ``gemv_tc(split=2)`` runs it."""
    from ninfer.ops.triton import quant_gemv_streamk, quant_gemv_tc

    k, m = 2048, 1
    n = 512 if variant == "norm_swiglu" else 3 * 128
    w = _kw(random_packed(gen, Q4, n, k, DEVICE))
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    res, nw = _norm_args(gen, m, k)
    blocks = n // 128

    def call(fn, **kw):
        h, ro = torch.empty_like(x), torch.empty_like(x)
        norm = (res, nw, 1e-6, h, ro) if variant != "plain" else None
        y = fn(x, w, norm=norm, swiglu=variant == "norm_swiglu", **kw)
        return (y, h, ro) if norm else (y,)

    sk = call(quant_gemv_streamk.gemv_tc, slots=2 * blocks)
    ref = call(quant_gemv_tc.gemv_tc, split=2)
    for a, b in zip(sk, ref, strict=True):
        assert torch.equal(a, b)
    assert _counters_zero()


@pytest.mark.parametrize("m,n,k,slots", [(1, 300, 2048, 5), (3, 400, 2048, 7), (8, 600, 1024, 3)]
                         + ([(1, 4096, 4096, None), (8, 12288, 4096, None), (1, 2048, 12288, None)] if CUDA else []))
def test_uneven_shares_stay_within_the_tensor_core_bound(m, n, k, slots, gen):
    """Shares that span two row blocks and blocks of different contributor counts (5 programs over 3 blocks of 4
    steps: 12 units in shares of 2-3); the norm's stored rows equal the row-block kernel's (each lane formed once,
    the same way)."""
    from ninfer.ops.triton import quant_gemv_streamk, quant_gemv_tc

    pw = random_packed(gen, Q4, n, k, DEVICE)
    w = _kw(pw)
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    y = quant_gemv_streamk.gemv_tc(x, w, slots=slots)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert_dot_bound(y, x, pw, u=U_TC, extra=3, what=f"stream-K {m}x{k}->{n} over {slots} programs")
    assert _counters_zero()
    res, nw = _norm_args(gen, m, k)
    outs = []
    for fn, kw in ((quant_gemv_streamk.gemv_tc, {"slots": slots}), (quant_gemv_tc.gemv_tc, {})):
        h, ro = torch.empty_like(x), torch.empty_like(x)
        fn(x, w, norm=(res, nw, 1e-6, h, ro), **kw)
        outs.append((h, ro))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_swiglu_with_uneven_gate_and_up_blocks(gen):
    """SwiGLU over 7 programs: the gate and up blocks of a pair have different contributor counts; the result is
    silu(gate) * up of the plain product's halves to a bf16 ulp, and within the bound of each half's oracle."""
    from ninfer.ops.triton import quant_gemv_streamk

    k, n = 2048, 768                     # 3 gate + 3 up blocks of 128 rows, 4 K steps each
    pw = random_packed(gen, Q4, n, k, DEVICE)
    w = _kw(pw)
    x = randn(gen, 2, k, dtype=torch.bfloat16, device=DEVICE)
    fused = quant_gemv_streamk.gemv_tc(x, w, swiglu=True, slots=7)
    plain = quant_gemv_streamk.gemv_tc(x, w, slots=7).float()
    g, u = plain[:, : n // 2], plain[:, n // 2:]
    want = (g * torch.sigmoid(g) * u).bfloat16().float()
    assert fused.shape == (2, n // 2)
    assert ((fused.float() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all()
    assert _counters_zero()


def test_what_stream_k_cannot_pair_runs_the_row_block_kernel(gen):
    """A SwiGLU weight whose half is not whole row blocks (I = 200, BN = 128): the row-block kernel's ``fill``
    split, the same bits."""
    from ninfer.ops.triton import quant_gemv_streamk, quant_gemv_tc

    k = 1024
    w = _kw(random_packed(gen, Q4, 400, k, DEVICE))
    x = randn(gen, 1, k, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(quant_gemv_streamk.gemv_tc(x, w, swiglu=True), quant_gemv_tc.gemv_tc(x, w, swiglu=True))


def test_the_split_setting_routes_q4_to_stream_k(gen, monkeypatch):
    """``NINFER_QUANT_SPLIT=streamk`` (SPLIT_RULE): the dense quantized ops take the stream-K module for q4 (the
    8-bit formats keep theirs), and the results stay within the tensor-core bound."""
    from ninfer.ops.triton import quant_gemv_streamk, quant_gemv_tc, quant_gemv_tc8, quant_linear

    monkeypatch.setattr(quant_gemv_tc, "SPLIT_RULE", "streamk")
    monkeypatch.setattr(quant_gemv_tc, "_TARGET_PROGRAMS", 5)
    pw = random_packed(gen, Q4, 300, 2048, DEVICE)
    x = randn(gen, 1, 2048, dtype=torch.bfloat16, device=DEVICE)
    assert quant_linear.tc_module(x, _kw(pw)) is quant_gemv_streamk
    q8 = random_packed(gen, "q8_g32_fp16", 300, 2048, DEVICE)
    assert quant_linear.tc_module(torch.cat([x, x]), _kw(q8)) is quant_gemv_tc8
    y = quant_linear.linear(x, pw)
    assert_dot_bound(y, x, pw, u=U_TC, extra=3, what="linear through stream-K")
