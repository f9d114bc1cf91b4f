"""The tensor-core decode GEMVs (``ninfer.ops.triton.quant_gemv_tc`` for q4, ``quant_gemv_tc8`` for q8 and fp8)
against the fp64 oracle of the decoded weights with the tensor-core bound of tests/ops_triton/quant_cases.py
(``U_TC``): 1 to 8 rows of x (every launch shape), the row mask, split-K and its partials' kernel, logits stored as
fp32, the dense ops routed to them when ``NINFER_QUANT_GEMV=tc`` (the fused norm and SwiGLU variants as their
composition) and where ``auto`` routes them. What they refuse (other formats, more rows, rows that are not whole K steps, a base plane at an odd
byte) goes to the CUDA-core GEMV. Runs on CUDA when present (where it checks the PTX decodes), otherwise under
TRITON_INTERPRET=1 at tiny sizes."""

import threading

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE, CountLaunches, triton_ops  # noqa: E402
from .quant_cases import U_TC, assert_dot_bound, random_packed  # noqa: E402

Q4, Q8, FP8 = "q4_g64_fp16", "q8_g32_fp16", "fp8_e4m3fn_row_bf16"
FORMATS = [Q4, Q8, FP8]
SHAPES = [(1, 40, 512), (2, 70, 512), (3, 33, 1024), (5, 9, 256), (8, 130, 512)]
if CUDA:
    SHAPES += [(1, 4096, 4096), (1, 2048, 12288), (8, 1000, 4096), (4, 24576, 4096)]


def _kw(w):
    from ninfer.ops.triton._quant import kernel_weight

    return kernel_weight(w, "t")


def _module(fmt):
    from ninfer.ops.triton import quant_gemv_tc, quant_gemv_tc8

    return quant_gemv_tc if fmt == Q4 else quant_gemv_tc8


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_within_the_tensor_core_bound(fmt, m, n, k, gen):
    w = random_packed(gen, fmt, n, k, DEVICE)
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    out = _module(fmt).gemv_tc(x, _kw(w))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_dot_bound(out, x, w, u=U_TC, extra=2, what=f"tc gemv {fmt} {m}x{k}->{n}")


def test_every_8_bit_code_decodes_exactly(gen):
    """All 256 byte values of each 8-bit format: weight row r holds byte r at lane r (zeros elsewhere, unit
    scales), x the identity's rows, so output (r, r) is the decoded code itself and must equal the format's value
    exactly (the PTX decode on CUDA, the integer path under the interpreter). fp8's two NaN codes are skipped."""
    import dataclasses

    from ninfer.ops.triton import quant_gemv_tc8

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    eye = torch.eye(256, dtype=torch.bfloat16, device=DEVICE)
    for fmt, want in ((Q8, codes.view(torch.int8).float()), (FP8, codes.view(torch.float8_e4m3fn).float())):
        kw = _kw(random_packed(gen, fmt, 256, 256, DEVICE))
        base = torch.diag(codes).to(DEVICE)
        scales = torch.ones_like(kw.scales)
        kw = dataclasses.replace(kw, base=base, base_stride=256, scales=scales, scale_stride=scales.stride(0))
        got = torch.cat([quant_gemv_tc8.gemv_tc(eye[i:i + 8], kw, out_dtype=torch.float32)
                         for i in range(0, 256, 8)])
        diag = got.diagonal().cpu()
        finite = ~want.isnan()
        assert int(finite.sum()) == (256 if fmt == Q8 else 254)
        assert torch.equal(diag[finite], want[finite]), fmt


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_k_and_fp32_logits(fmt, split, gen):
    """Splits (partials summed in a second kernel, rounded once) stay within the bound, and logits are stored as
    fp32 from the same rounding to bf16."""
    gemv_tc = _module(fmt).gemv_tc
    w = random_packed(gen, fmt, 21, 1536, DEVICE)
    x = randn(gen, 2, 1536, dtype=torch.bfloat16, device=DEVICE)
    out = gemv_tc(x, _kw(w), split=split)
    assert_dot_bound(out, x, w, u=U_TC, extra=2, what=f"{fmt} split {split}")
    logits = gemv_tc(x, _kw(w), split=split, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, out.float())


def test_refuses_what_it_cannot_take(gen):
    from ninfer.ops.triton import quant_gemv_tc8
    from ninfer.ops.triton.quant_gemv_tc import gemv_tc, launch_shape

    x = randn(gen, 1, 384, dtype=torch.bfloat16, device=DEVICE)
    assert launch_shape(1, _kw(random_packed(gen, Q4, 8, 384, DEVICE))) is None      # 192 bytes: not 256-byte steps
    assert launch_shape(9, _kw(random_packed(gen, Q4, 8, 512, DEVICE))) is None       # more rows than MAX_ROWS
    assert launch_shape(1, _kw(random_packed(gen, Q8, 8, 512, DEVICE))) is None
    assert launch_shape(1, _kw(random_packed(gen, Q4, 8, 514, DEVICE, skip=1))) is None  # base at an odd byte
    with pytest.raises(ValueError, match="cannot take"):
        gemv_tc(x, _kw(random_packed(gen, Q4, 8, 384, DEVICE)))
    with pytest.raises(ValueError, match="cannot take"):
        gemv_tc(randn(gen, 1, 512, device=DEVICE), _kw(random_packed(gen, Q4, 8, 512, DEVICE)))   # fp32 x
    shape8 = quant_gemv_tc8.launch_shape
    assert shape8(1, _kw(random_packed(gen, Q8, 8, 384, DEVICE))) is None             # 384 lanes: not 256-lane steps
    assert shape8(8, _kw(random_packed(gen, Q8, 8, 384, DEVICE))) is not None         # 32-lane steps at 8 rows
    assert shape8(1, _kw(random_packed(gen, FP8, 8, 500, DEVICE))) is None            # K not a multiple of 256
    assert shape8(9, _kw(random_packed(gen, FP8, 8, 512, DEVICE))) is None
    assert shape8(1, _kw(random_packed(gen, Q4, 8, 512, DEVICE))) is None
    assert shape8(1, _kw(random_packed(gen, FP8, 8, 513, DEVICE, skip=1))) is None    # base at an odd byte
    with pytest.raises(ValueError, match="cannot take"):
        quant_gemv_tc8.gemv_tc(x, _kw(random_packed(gen, FP8, 8, 384, DEVICE)))


@pytest.fixture
def tc_on(monkeypatch):
    from ninfer.ops.triton import quant_gemv_tc

    monkeypatch.setattr(quant_gemv_tc, "MODE", "tc")


def test_auto_runs_them_where_they_were_measured_faster(gen, monkeypatch):
    """``NINFER_QUANT_GEMV=auto`` (the default): q4 from one row, over the GEMM too; fp8 from two rows, over the
    GEMM too; q8 from two rows where the CUDA-core GEMV would run, not where the GEMM would. ``tc`` takes every
    call they can, ``cuda`` none; fp32 activations never."""
    from ninfer.ops.triton import quant_gemv_tc
    from ninfer.ops.triton.quant_linear import GEMM_MIN_N, tc_module

    def chosen(fmt, rows, n, dtype=torch.bfloat16):
        x = torch.zeros(rows, 512, dtype=dtype, device=DEVICE)
        module = tc_module(x, _kw(random_packed(gen, fmt, n, 512, DEVICE)))
        return None if module is None else module.__name__.rsplit(".", 1)[-1]

    assert quant_gemv_tc.MODE == "auto"
    wide = GEMM_MIN_N
    assert [chosen(Q4, r, 64) for r in (1, 2, 8)] == ["quant_gemv_tc"] * 3
    assert chosen(Q4, 8, wide) == "quant_gemv_tc"
    assert [chosen(FP8, r, 64) for r in (1, 2, 8)] == [None, "quant_gemv_tc8", "quant_gemv_tc8"]
    assert chosen(FP8, 8, wide) == "quant_gemv_tc8"
    assert [chosen(Q8, r, 64) for r in (1, 2, 8)] == [None, "quant_gemv_tc8", "quant_gemv_tc8"]
    assert chosen(Q8, 3, wide) == "quant_gemv_tc8" and chosen(Q8, 4, wide) is None    # the GEMM's from 4 rows
    assert chosen(Q4, 1, 64, torch.float32) is None
    monkeypatch.setattr(quant_gemv_tc, "MODE", "tc")
    assert chosen(FP8, 1, 64) == "quant_gemv_tc8" and chosen(Q8, 8, wide) == "quant_gemv_tc8"
    monkeypatch.setattr(quant_gemv_tc, "MODE", "cuda")
    assert chosen(Q4, 1, 64) is None and chosen(FP8, 8, 64) is None


def test_an_unknown_mode_is_named():
    import os
    import subprocess
    import sys

    env = dict(os.environ, NINFER_QUANT_GEMV="fast")
    run = subprocess.run([sys.executable, "-c", "import ninfer.ops.triton.quant_gemv_tc"], capture_output=True,
                         text=True, env=env)
    assert run.returncode != 0 and "NINFER_QUANT_GEMV='fast': expected one of auto, tc, cuda" in run.stderr


@pytest.mark.parametrize("name,value,message", [("NINFER_QUANT_SPLIT", "most", "expected one of fill, wave, streamk"),
                                                ("NINFER_QUANT_PREFETCH", "yes", "expected 0 or 1"),
                                                ("NINFER_QUANT_L2_PREFETCH", "on", "expected 0 or 1"),
                                                ("NINFER_QUANT_NORM", "both", "expected one of fused, separate")])
def test_an_unknown_candidate_setting_is_named(name, value, message):
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{name: value})
    run = subprocess.run([sys.executable, "-c", "import ninfer.ops.triton.quant_linear"], capture_output=True,
                         text=True, env=env)
    assert run.returncode != 0 and f"{name}={value!r}: {message}" in run.stderr


def test_the_candidate_settings_reach_the_launch(gen, monkeypatch):
    """``NINFER_QUANT_SPLIT``, ``NINFER_QUANT_PREFETCH`` and ``NINFER_QUANT_L2_PREFETCH`` (read at import into
    SPLIT_RULE, PREFETCH and L2_PREFETCH) are what a call without ``split`` / ``prefetch`` / ``l2_prefetch``
    launches with; the L2 prefetch only where its 16-byte alignment holds."""
    from ninfer.ops.triton import quant_gemv_tc

    seen = []
    real = quant_gemv_tc._q4_tc_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.append((grid[1], kw["PREFETCH"], kw["L2PF"]))
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(quant_gemv_tc, "_q4_tc_kernel", Spy())
    # 3 row blocks of 8 K steps at one row, 8 programs at once: fill takes 3 runs (9 programs, two waves), wave 2.
    monkeypatch.setattr(quant_gemv_tc, "_TARGET_PROGRAMS", 8)
    w = _kw(random_packed(gen, Q4, 3 * 128, 4096, DEVICE))
    x = randn(gen, 1, 4096, dtype=torch.bfloat16, device=DEVICE)
    plain = quant_gemv_tc.gemv_tc(x, w)
    monkeypatch.setattr(quant_gemv_tc, "SPLIT_RULE", "wave")
    monkeypatch.setattr(quant_gemv_tc, "PREFETCH", True)
    monkeypatch.setattr(quant_gemv_tc, "L2_PREFETCH", True)
    chosen = quant_gemv_tc.gemv_tc(x, w)
    # The same weight read from a base plane 2 bytes into its storage: no bulk prefetch of unaligned rows.
    import dataclasses
    shifted = torch.empty(w.base.numel() + 2, dtype=torch.uint8, device=DEVICE)[2:].view(w.base.shape)
    shifted.copy_(w.base)
    again = quant_gemv_tc.gemv_tc(x, dataclasses.replace(w, base=shifted))
    assert seen == [(3, False, False), (2, True, True), (2, True, False)]
    assert torch.equal(again, chosen)
    assert (chosen.float() - plain.float()).abs().max() <= plain.float().abs().max() * 2.0 ** -7


def test_split_rules():
    """``fill``: at least the target's programs (no more runs than steps); ``wave``: no program spilled into a
    partial wave when one fewer run avoids it (the 9B in-projection at one row: 97 row blocks x 3 runs are 291
    programs, two waves of 264, so 2 runs), and more runs where whole waves come out shorter; never an empty run."""
    from ninfer.ops.triton.quant_gemv_tc import split_count

    assert [split_count(p, 8, "fill", 264) for p in (97, 192, 32, 1940)] == [3, 2, 8, 1]
    assert [split_count(p, 8, "wave", 264) for p in (97, 192, 32, 1940)] == [2, 1, 8, 1]
    assert split_count(49, 32, "wave", 264) == 5 and split_count(49, 32, "fill", 264) == 6
    assert split_count(96, 32, "wave", 264) == 8      # 768 programs: three nearly full waves of 4 steps
    for programs in (1, 7, 97, 300):
        for steps in (1, 3, 8, 24, 100):
            for rule in ("fill", "wave"):
                s = split_count(programs, steps, rule, 264)
                tps = -(-steps // s)
                assert 1 <= s <= steps and (s - 1) * tps < steps, (programs, steps, rule, s)
    with pytest.raises(ValueError, match="split rule 'most'"):
        split_count(4, 4, "most")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("norm_mode", ["fused", "separate"])
def test_dense_ops_take_it_when_enabled(fmt, rows, norm_mode, gen, tc_on, monkeypatch):
    """linear, logits and the fused norm / SwiGLU ops run the format's tensor-core GEMV (counted) and stay within
    its bound. Fused: the new residual is the Triton norm's bit for bit, the normed rows within one bf16 ulp of it
    (another order of the sum of squares; ``NINFER_QUANT_NORM=separate``: the norm kernel's, bit for bit), the
    product is the plain call's on the normed rows it stored, and the SwiGLU is silu_and_mul of that product (its
    partials rounded to bf16 first, as the op rounds)."""
    from ninfer.ops.triton import quant_linear

    monkeypatch.setattr(quant_linear, "NORM_MODE", norm_mode)
    module = _module(fmt)
    calls = []
    real = module.gemv_tc
    monkeypatch.setattr(module, "gemv_tc", lambda *a, **k: calls.append(1) or real(*a, **k))
    ops = triton_ops(torch.bfloat16)
    hidden, inter = (512 if fmt == FP8 else 500), 24    # groupwise K not a multiple of 128: padded lanes masked
    w = random_packed(gen, fmt, 37, hidden, DEVICE)
    x = randn(gen, rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    assert_dot_bound(ops.linear(x, w), x, w, u=U_TC, extra=2, what="linear")
    lg = ops.logits(x, w)
    assert lg.dtype == torch.float32 and torch.equal(lg, ops.linear(x, w).float())
    res = randn(gen, rows, hidden, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, hidden, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    y, h, new_res = ops.add_rms_norm_unit_offset_linear(x, res, nw, 1e-6, w)
    h_sep, res_sep = ops.add_rms_norm_unit_offset(x, res, nw, 1e-6)
    assert torch.equal(new_res, res_sep)
    assert (h.float() - h_sep.float()).abs().max() <= h_sep.float().abs().max() * 2.0 ** -7
    assert norm_mode == "fused" or torch.equal(h, h_sep)
    assert torch.equal(y, ops.linear(h, w))
    gate_up = random_packed(gen, fmt, 2 * inter, hidden, DEVICE)
    act, h2, res2 = ops.add_rms_norm_unit_offset_swiglu(x, res, nw, 1e-6, gate_up)
    assert torch.equal(h2, h) and torch.equal(res2, new_res)
    assert act.shape == (rows, inter) and torch.equal(act, ops.silu_and_mul(ops.linear(h, gate_up)))
    assert len(calls) == 7   # linear x2, logits, the fused linear, linear(h), the fused SwiGLU, linear of gate_up


@pytest.mark.parametrize("fmt", FORMATS)
def test_norm_stores_are_complete_with_split_k(fmt, gen):
    """With several K runs and several row blocks, the normed rows and the new residual are stored whole (each
    lane by row block 0's program of its run)."""
    from ninfer.ops.triton import norm as tnorm

    gemv_tc = _module(fmt).gemv_tc
    k = 2048
    w = random_packed(gen, fmt, 300, k, DEVICE)
    x = randn(gen, 3, k, dtype=torch.bfloat16, device=DEVICE)
    res = randn(gen, 3, k, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, k, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    h = torch.full_like(x, float("nan"))
    ro = torch.full_like(x, float("nan"))
    y = gemv_tc(x, _kw(w), norm=(res, nw, 1e-6, h, ro), split=4)
    h_sep, res_sep = tnorm.add_rms_norm_unit_offset(x, res, nw, 1e-6)
    assert torch.equal(ro, res_sep) and not h.isnan().any()
    assert (h.float() - h_sep.float()).abs().max() <= h_sep.float().abs().max() * 2.0 ** -7
    assert torch.equal(y, gemv_tc(h, _kw(w), split=4))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("swiglu,n,split", [(False, 300, 3), (False, 256, 1), (True, 512, 1), (True, 512, 3)])
def test_split_k_sum_in_the_kernel_equals_the_sum_kernel(fmt, rows, swiglu, n, split, gen, monkeypatch):
    """The last program of an output block adds the partials in the kernel (no second launch) and gets the second
    kernel's result bit for bit (the same fp32 order, one rounding, SwiGLU of the rounded gate and up); the block
    ticket counters are all zero again after the call. With ``in_kernel_sum=False`` (the 8-bit kernels' default),
    or without the counters (more output blocks than counters, or a SwiGLU half that is not whole blocks), the
    second kernel runs."""
    from ninfer.ops.triton import _splitk

    module = _module(fmt)
    k = 2048   # K steps enough for three runs in every format
    w = _kw(random_packed(gen, fmt, n, k, DEVICE))
    x = randn(gen, rows, k, dtype=torch.bfloat16, device=DEVICE)
    counted = CountLaunches(_splitk._sum_kernel)
    monkeypatch.setattr(_splitk, "_sum_kernel", counted)
    fused = module.gemv_tc(x, w, swiglu=swiglu, split=split, in_kernel_sum=True)
    partials = split > 1 or swiglu
    assert counted.launches == 0
    if partials:
        assert not _splitk._TICKETS[x.device, threading.get_ident()].any()
    chosen = module.gemv_tc(x, w, swiglu=swiglu, split=split, in_kernel_sum=False)
    assert counted.launches == (1 if partials else 0)
    # The module's default: the q4 kernel sums in the kernel, the 8-bit ones in the second kernel.
    default = module.gemv_tc(x, w, swiglu=swiglu, split=split)
    assert counted.launches == (1 if partials else 0) * (1 if fmt == Q4 else 2)
    monkeypatch.setattr(_splitk, "_MAX_BLOCKS", 0)
    second = module.gemv_tc(x, w, swiglu=swiglu, split=split, in_kernel_sum=True)
    assert counted.launches == (1 if partials else 0) * (2 if fmt == Q4 else 3)
    assert torch.equal(fused, second) and torch.equal(fused, chosen) and torch.equal(fused, default)
    if swiglu:   # silu(gate) * up of the plain product's rounded halves (to one bf16 ulp: exp's implementation)
        plain = module.gemv_tc(x, w, split=split).float()
        g, u = plain[:, : n // 2], plain[:, n // 2:]
        want = (g * torch.sigmoid(g) * u).bfloat16().float()
        assert fused.shape == (rows, n // 2)
        assert ((fused.float() - want).abs() <= want.abs() * 2.0 ** -7).all()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("variant", ["plain", "split", "norm", "swiglu"])
def test_q4_prefetch_gives_the_same_bits(rows, variant, gen):
    """The first weight tile loaded before the PDL wait and the norm prologue (``prefetch``): the same products in
    the same order, so the same bits, the norm's stored rows included."""
    from ninfer.ops.triton import quant_gemv_tc

    k = 2048
    n = 512 if variant == "swiglu" else 300
    w = _kw(random_packed(gen, Q4, n, k, DEVICE))
    x = randn(gen, rows, k, dtype=torch.bfloat16, device=DEVICE)
    res = randn(gen, rows, k, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, k, dtype=torch.bfloat16, device=DEVICE, scale=0.3)

    def call(prefetch):
        h, ro = torch.empty_like(x), torch.empty_like(x)
        norm = (res, nw, 1e-6, h, ro) if variant in ("norm", "swiglu") else None
        y = quant_gemv_tc.gemv_tc(x, w, norm=norm, swiglu=variant == "swiglu",
                                  split=3 if variant == "split" else None, prefetch=prefetch)
        return (y, h, ro) if norm else (y,)

    for a, b in zip(call(False), call(True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", ["split", "norm_swiglu"])
def test_l2_prefetch_gives_the_same_bits(fmt, variant, gen):
    """Each program's weight run asked of L2 before the PDL wait (``l2_prefetch``): no value passes through it, so
    the same bits, the norm's stored rows included (on CUDA, the bulk prefetch instruction runs; the interpreter
    has no cache and skips it)."""
    k = 1024
    rows = (1, 8) if CUDA else (3,)
    n = 512 if variant == "norm_swiglu" else 300
    w = _kw(random_packed(gen, fmt, n, k, DEVICE))
    for m in rows:
        x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
        res = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
        nw = randn(gen, k, dtype=torch.bfloat16, device=DEVICE, scale=0.3)

        def call(l2, x=x, res=res, nw=nw):
            h, ro = torch.empty_like(x), torch.empty_like(x)
            norm = (res, nw, 1e-6, h, ro) if variant == "norm_swiglu" else None
            y = _module(fmt).gemv_tc(x, w, norm=norm, swiglu=norm is not None,
                                     split=None if norm else 2, l2_prefetch=l2)
            return (y, h, ro) if norm else (y,)

        for a, b in zip(call(False), call(True), strict=True):
            assert torch.equal(a, b)
