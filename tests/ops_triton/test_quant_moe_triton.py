"""Triton moe_experts on quantized expert banks vs the CPU reference op (ninfer.ops.reference.quantized), for every
stored format, on both paths (decode GEMVs, grouped GEMMs), with and without a shared expert (packed or dense).

Runs on CUDA when present, otherwise on CPU tensors under the Triton interpreter at tiny sizes. Banks are packed
into a parent's stored bytes behind a leading expert, so every plane view starts at a nonzero offset, as views of
a loaded artifact do. nvfp4 needs whole 128-row scale tiles per expert and K % 64 == 0, so its cases take
H = 128 (gate/up rows 2I = 128, the down bank's H rows) and I = 64 where the others take H = 40, I = 24.

Criterion (elementwise, from the arithmetic): decoded weights ``scale * code`` are exact in fp32, so kernel and
reference compute the same fp32 expression and differ only by summation order, fp32 silu/sigmoid evaluation and
the roundings each one makes. :func:`bound` bounds, per output element, the distance of each from the exact value
of that expression to first order (dot products of n terms: gamma(n) * sum|terms| with a unit roundoff of
2^-23, twice fp32's, which also covers accumulators that truncate), propagates it through SwiGLU (|silu'| <=
1.1) and the down projection, and adds the roundings only one side makes: the output rounding to x.dtype (one
spacing, 2^(1-p) relative), the shared activation's rounding (either side may land one spacing away), the grouped
path's activation rounded to a 16-bit x.dtype (the reference keeps fp32), and the reference's bf16 product for a
dense 16-bit shared down projection. An nvfp4 weight adds two roundings to each dot (the division by its divisor,
and the reference's decoded weight ``e2m1 * scale / divisor`` rounded to fp32).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from ninfer.ops.contracts import SharedExpert  # noqa: E402
from ninfer.ops.reference import quantized as ref  # noqa: E402
from ninfer.ops.triton import _common  # noqa: E402
from ninfer.quant import QUANTIZED_FORMATS, PackedWeight, packed_view  # noqa: E402

from .conftest import CUDA, DEVICE  # noqa: E402
from .quant_cases import parent_bytes  # noqa: E402

if not CUDA and not _common.INTERPRET:  # imported before the interpreter was set: re-define the kernels
    for name in ("_common", "_quant", "_quant_tiles", "moe", "quant_moe_gemv", "quant_moe"):
        importlib.reload(importlib.import_module(f"ninfer.ops.triton.{name}"))
from ninfer.ops.triton import quant_moe as qm  # noqa: E402
from ninfer.ops.triton import quant_moe_gemv as qg  # noqa: E402

FORMATS = list(QUANTIZED_FORMATS)   # what the Triton MoE kernels read: every stored format
NVFP4 = "nvfp4"
PATHS = ["gemv", "grouped"]
_U = 2.0 ** -23
_PRECISION = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


def pack(fmt: str, w: torch.Tensor) -> PackedWeight:
    """``w`` encoded in ``fmt`` as the view of the rows after a leading block of random rows (one expert of a
    bank, or one matrix: 3 rows, nvfp4 one 128-row scale tile) in a parent holding the stored bytes (nvfp4: one
    divisor for the whole parent, as the converter writes a bank)."""
    k = w.shape[-1]
    lead = torch.randn((1, *w.shape[1:]) if w.dim() == 3 else (128 if fmt == NVFP4 else 3, k), dtype=torch.float64)
    full = torch.cat((lead.to(w.dtype), w))
    parent = parent_bytes(fmt, full.reshape(-1, k)).to(DEVICE)
    begin = lead.numel()
    return packed_view(fmt, parent, tuple(full.shape), begin, begin + w.numel(), tuple(w.shape))


def dims(*fmts) -> tuple[int, int, int]:
    """(H, I, shared I) of a case whose weights are in ``fmts``: nvfp4's layout needs whole 128-row tiles and
    K % 64 == 0 (module docstring)."""
    return (128, 64, 64) if NVFP4 in fmts else (40, 24, 20)


def values(w) -> torch.Tensor:
    return (w.dequantize(torch.float64) if isinstance(w, PackedWeight) else w.double()).cpu()


def make(gen, fmt, t_len, hidden=None, inter=None, n_exp=6, top_k=2, dtype=torch.float32, down_fmt=None, ids=None):
    d_hidden, d_inter, _ = dims(fmt, down_fmt)
    hidden, inter = hidden or d_hidden, inter or d_inter
    x = (torch.randn(t_len, hidden, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)
    gate_up = torch.randn(n_exp, 2 * inter, hidden, generator=gen, dtype=torch.float64) * hidden ** -0.5
    down = torch.randn(n_exp, hidden, inter, generator=gen, dtype=torch.float64) * inter ** -0.5
    if ids is None:
        ids = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t_len)])
    weights = (0.1 + 0.9 * torch.rand(t_len, top_k, generator=gen, dtype=torch.float64)).float()
    return (x, weights.to(DEVICE), ids.to(DEVICE), pack(fmt, gate_up), pack(down_fmt or fmt, down))


def shared_expert(gen, t_len, hidden, dtype, fmt, s_inter=None):
    """A shared expert as the model passes it: projection and gate logit as views of one fused output."""
    s_inter = s_inter or dims(fmt)[2]
    fused = (torch.randn(t_len, 3 + 2 * s_inter + 1, generator=gen, dtype=torch.float64) * 2).to(dtype).to(DEVICE)
    down = torch.randn(hidden, s_inter, generator=gen, dtype=torch.float64) * s_inter ** -0.5
    down = down.to(dtype).to(DEVICE) if fmt is None else pack(fmt, down)
    return SharedExpert(projected=fused[:, 3:3 + 2 * s_inter], down=down, gate_logit=fused[:, -1])


def _gamma(n: int) -> float:
    return n * _U / (1 - n * _U)


def _extra(w) -> int:
    """Roundings of a dot with ``w`` besides its lanes': scales and chunk partials; nvfp4 two more (docstring)."""
    return 4 if isinstance(w, PackedWeight) and w.format == NVFP4 else 2


def bound(x, weights, ids, gate_up, down, shared, grouped: bool) -> torch.Tensor:
    """Per-element bound on |kernel - reference| (module docstring). ``spacing``: the largest relative gap
    between neighbours of x.dtype (2^(1-p)); ``rnd``: its round-to-nearest error (2^-p)."""
    dtype = x.dtype
    spacing, rnd = 2.0 ** (1 - _PRECISION[dtype]), 2.0 ** -_PRECISION[dtype]
    act_rounded = grouped and dtype != torch.float32
    xd, w, ids = x.double().cpu(), weights.double().cpu(), ids.cpu()
    gu, dn = values(gate_up), values(down)
    inter, hidden = dn.shape[-1], xd.shape[1]
    n_gu, n_dn = hidden + _extra(gate_up), inter + _extra(down)
    err = torch.zeros(xd.shape[0], hidden, dtype=torch.float64)     # the two sides' distance before rounding
    magnitude = torch.zeros_like(err)                                # sum of |terms| of the final sum
    for t in range(xd.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = gu[e, :inter] @ xd[t], gu[e, inter:] @ xd[t]
            dg = _gamma(n_gu) * (gu[e, :inter].abs() @ xd[t].abs())
            du = _gamma(n_gu) * (gu[e, inter:].abs() @ xd[t].abs())
            silu = g * torch.sigmoid(g)
            act = silu * u
            # |silu'| <= 1.1; the fp32 silu and product add a few roundings of their own.
            d_act = 1.1 * dg * (u.abs() + du) + silu.abs() * du + 8 * _U * act.abs()
            mag = dn[e].abs() @ (act.abs() + d_act)
            d_y = 2 * (dn[e].abs() @ d_act + _gamma(n_dn) * mag)   # either side's error, so twice
            if act_rounded:
                d_y = d_y + rnd * mag
            err[t] += w[t, j] * d_y
            magnitude[t] += w[t, j] * mag
    if shared is not None:
        p, sd, gl = shared.projected.double().cpu(), values(shared.down), shared.gate_logit.double().cpu()
        s_inter = sd.shape[-1]
        act = (p[:, :s_inter] * torch.sigmoid(p[:, :s_inter]) * p[:, s_inter:]).abs()
        mag = torch.sigmoid(gl)[:, None] * (act @ sd.abs().t())
        # Each side rounds its own fp32 silu(g) * u (a few roundings apart) to x.dtype: one spacing apart at
        # most; then each side's dot and sigmoid.
        err += mag * (spacing + 16 * _U + 2 * _gamma(s_inter + _extra(shared.down)))
        if not isinstance(shared.down, PackedWeight) and dtype != torch.float32:
            err += mag * rnd          # the reference rounds a dense 16-bit shared product to x.dtype
        magnitude += mag
    err += 2 * _gamma(ids.shape[1] + 2) * magnitude
    exact = ref.moe_experts(xd, w, ids, gu, dn, shared=None if shared is None else SharedExpert(
        shared.projected.double().cpu(), values(shared.down), shared.gate_logit.double().cpu()))
    return err + spacing * (exact.abs() + err)


def check(out, args, shared=None, *, grouped: bool, what: str) -> None:
    x = args[0]
    expect = ref.moe_experts(*(a.cpu() if isinstance(a, torch.Tensor) else _cpu(a) for a in args),
                             shared=None if shared is None else _cpu_shared(shared))
    assert out.dtype == x.dtype and out.shape == x.shape, what
    limit = bound(*args, shared, grouped)
    scale = expect.double().abs().max().item()
    assert limit.max().item() < 0.05 * scale, f"{what}: the bound is too loose to test anything"
    err = (out.double().cpu() - expect.double()).abs()
    assert torch.isfinite(out).all() and (err <= limit).all(), (
        f"{what}: {int((err > limit).sum())} elements over the bound; worst err {err.max().item():.3e}, "
        f"err/bound {(err / limit).max().item():.2f}")


def _cpu(w: PackedWeight) -> PackedWeight:
    return PackedWeight(w.format, w.shape, tuple(p.cpu() for p in w.planes))


def _cpu_shared(s: SharedExpert) -> SharedExpert:
    down = _cpu(s.down) if isinstance(s.down, PackedWeight) else s.down.cpu()
    return SharedExpert(s.projected.cpu(), down, s.gate_logit.cpu())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,top_k", [(1, 2), (6, 3)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_routed_experts_match_reference(fmt, t_len, top_k, dtype, path, gen):
    # H = 40: one 128-lane stored row of which 88 lanes are padding (nvfp4: H = 128, I = 64, one scale tile of
    # gate/up rows and one of down rows per expert); E = 6 with at most 18 pairs: some experts idle.
    args = make(gen, fmt, t_len, top_k=top_k, dtype=dtype)
    out = qm.moe_experts(*args, gemv=path == "gemv")
    check(out, args, grouped=path == "grouped", what=f"{fmt} {dtype} T={t_len} k={top_k} {path}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shared_fmt", ["same", "q8_g32_fp16", "dense"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_shared_expert_joins_the_sum(fmt, shared_fmt, path, gen):
    t_len, dtype = 5, torch.bfloat16
    args = make(gen, fmt, t_len, dtype=dtype)
    s_fmt = {"same": fmt, "dense": None}.get(shared_fmt, shared_fmt)
    shared = shared_expert(gen, t_len, args[0].shape[1], dtype, s_fmt)
    out = qm.moe_experts(*args, shared=shared, gemv=path == "gemv")
    check(out, args, shared, grouped=path == "grouped", what=f"{fmt} + shared {shared_fmt} {path}")
    alone = qm.moe_experts(*args, gemv=path == "gemv")
    assert (alone.double() - out.double()).norm() > 0.1 * out.double().norm()   # the shared term is there


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gu_fmt,dn_fmt,sh_fmt", [("q4_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"),
                                                  (NVFP4, "q8_g32_fp16", NVFP4),
                                                  ("fp8_e4m3fn_row_bf16", NVFP4, "q4_g64_fp16")])
def test_fp32_shared_and_mixed_formats(gu_fmt, dn_fmt, sh_fmt, path, gen):
    # Each bank and the shared down projection in its own format (a recipe may give each its own; nvfp4 as either
    # bank or the shared expert's), fp32 activations: tight bounds.
    hidden, inter, s_inter = dims(gu_fmt, dn_fmt, sh_fmt)
    args = make(gen, gu_fmt, 4, hidden=hidden, inter=inter, top_k=3, down_fmt=dn_fmt)
    shared = shared_expert(gen, 4, hidden, torch.float32, sh_fmt, s_inter)
    check(qm.moe_experts(*args, shared=shared, gemv=path == "gemv"), args, shared, grouped=path == "grouped",
          what=f"mixed formats {gu_fmt}/{dn_fmt}/{sh_fmt} {path}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_several_chunks_and_row_blocks(monkeypatch, fmt, path, gen):
    # H = 200 (a 256-lane stored row: several groups), one K chunk per group on the decode path, and on the grouped
    # path 20 tokens all routed to expert 1 (a group spanning two 16-row blocks) with fp16 activations. nvfp4: H = 256,
    # I = 128 (two scale-tile rows per expert in each bank, four tile columns of gate/up and two of down: one
    # decode chunk each).
    monkeypatch.setattr(qg, "_CHUNK_LANES", 64)
    t_len = 20
    ids = torch.stack((torch.ones(t_len, dtype=torch.int64), torch.randint(2, 5, (t_len,), generator=gen)), 1)
    hidden, inter = (256, 128) if fmt == NVFP4 else (200, 40)
    args = make(gen, fmt, t_len, hidden=hidden, inter=inter, dtype=torch.float16, ids=ids)
    out = qm.moe_experts(*args, gemv=path == "gemv")
    check(out, args, grouped=path == "grouped", what=f"{fmt} chunks/blocks {path}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["q5_g64_fp16", "fp8_e4m3fn_row_bf16", NVFP4])
def test_unused_experts_are_never_read_into_the_sum(fmt, path, gen):
    # Experts 0, 4, 5 are routed to by no token: scrambling their bytes changes nothing, bit for bit (nvfp4: their
    # codes and scale tiles; the divisor is the whole bank's).
    ids = torch.tensor([[1, 2], [3, 1], [2, 3]])
    args = make(gen, fmt, 3, dtype=torch.bfloat16, ids=ids)
    before = qm.moe_experts(*args, gemv=path == "gemv")
    for bank in args[3:]:
        for e in (0, 4, 5):
            for plane in bank.planes:
                per = plane.shape[0] // bank.shape[0]        # an expert's plane rows (0 for the shared divisor)
                rows = plane[e * per:(e + 1) * per]
                rows.copy_(torch.randint(0, 256, rows.shape, generator=gen, dtype=torch.uint8).to(rows.device)
                           if rows.dtype == torch.uint8 else torch.full_like(rows, float("nan")))
    assert torch.equal(qm.moe_experts(*args, gemv=path == "gemv"), before)


def test_dense_bank_with_a_packed_one(gen):
    # A dense gate_up bank (x's dtype) beside a packed down bank; a dense operand of another dtype goes to the
    # reference unchanged.
    x, weights, ids, _, down = make(gen, "q8_g32_fp16", 3)
    gate_up = (torch.randn(6, 48, 40, generator=gen, dtype=torch.float64) * 40 ** -0.5).float().to(DEVICE)
    args = (x, weights, ids, gate_up, down)
    for path in PATHS:
        check(qm.moe_experts(*args, gemv=path == "gemv"), args, grouped=path == "grouped", what=f"dense gu {path}")
    mixed = (x.bfloat16(), weights, ids, gate_up, down)
    assert torch.equal(qm.moe_experts(*mixed).cpu(), ref.moe_experts(*mixed).cpu())


def test_deterministic_and_path_by_size(gen):
    args = make(gen, "q4_g64_fp16", 7, dtype=torch.bfloat16)
    assert torch.equal(qm.moe_experts(*args), qm.moe_experts(*args))
    assert torch.equal(qm.moe_experts(*args), qm.moe_experts(*args, gemv=True))    # 14 pairs: the decode path


def test_bad_shapes_are_named(gen):
    x, weights, ids, gate_up, down = make(gen, "q8_g32_fp16", 2)
    with pytest.raises(ValueError, match="gate_up"):
        qm.moe_experts(x[:, :32], weights, ids, gate_up, down)
    with pytest.raises(ValueError, match="ids"):
        qm.moe_experts(x, weights, ids[:1], gate_up, down)
    shared = shared_expert(gen, 2, 40, torch.float32, "q8_g32_fp16")
    with pytest.raises(ValueError, match="shared"):
        qm.moe_experts(x, weights, ids, gate_up, down, shared=SharedExpert(shared.projected[:1], shared.down,
                                                                           shared.gate_logit[:1]))
    # An nvfp4 bank whose experts do not fill whole 128-row scale tiles (the layout stores none such).
    x, weights, ids, gate_up, _ = make(gen, "q8_g32_fp16", 2, hidden=64, inter=64)
    planes = (torch.zeros(6 * 64, 32, dtype=torch.uint8), torch.zeros(3, 512, dtype=torch.uint8), torch.ones(1))
    odd = PackedWeight(NVFP4, (6, 64, 64), tuple(p.to(DEVICE) for p in planes))
    with pytest.raises(ValueError, match=r"down: an nvfp4 weight needs N % 128 == 0"):
        qm.moe_experts(x, weights, ids, gate_up, odd)


def test_registered_per_format_and_dispatched(gen):
    from .conftest import triton_ops

    assert [(i.op, i.priority, i.devices, i.weight_formats) for i in qm.OPS] == [
        ("moe_experts", 10, frozenset({"cuda"}), frozenset(FORMATS))]
    ops = triton_ops(torch.bfloat16)
    for fmt in FORMATS:
        assert ops.implementation("moe_experts", fmt).fn is qm.moe_experts
    args = make(gen, "q6_g64_fp16", 2, dtype=torch.bfloat16)
    assert torch.equal(ops.moe_experts(*args), qm.moe_experts(*args))    # the dispatcher routes packed banks here
