"""The q4 tensor-core decode GEMV candidates of tools/quant_gemv_candidates.py (``gemv_tc35``: codes decoded to
exact bf16 by inline PTX on the GPU, by the same arithmetic in plain ops under the interpreter) against the fp64
oracle of the decoded weights, with the tensor-core bound of tests/ops_triton/quant_cases.py: one and several rows,
several programs' worth of rows (the row mask), split-K, x read in its natural order (tc5) and pre-permuted (tc3).
They are experiments the engine does not call; on CUDA this is the first check that the PTX decode is exact. Also
the 8-bit decode variants of tools/quant_gemv_tc8_candidates.py (the engine's kernels with another decode)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE  # noqa: E402
from .quant_cases import U_TC, assert_dot_bound, random_packed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import quant_gemv_candidates as cand  # noqa: E402
import quant_gemv_tc8_candidates as cand8  # noqa: E402

CASES = [(1, 40, 512, 64, 8, None), (2, 70, 1024, 64, 4, 2), (5, 33, 1024, 64, 2, None)]
if CUDA:
    CASES += [(1, 4096, 4096, 128, 8, None), (8, 1000, 4096, 256, 2, None), (1, 300, 12288, 128, 8, 3)]


@pytest.mark.parametrize("natural", [True, False], ids=["tc5", "tc3"])
@pytest.mark.parametrize("m,n,k,bn,gpi,split", CASES)
def test_tc35_within_the_tensor_core_bound(natural, m, n, k, bn, gpi, split, gen):
    from ninfer.ops.triton._quant import kernel_weight

    w = random_packed(gen, "q4_g64_fp16", n, k, DEVICE)
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    xin = x if natural else x[:, cand.perm_tc3(k).to(x.device)].contiguous()
    out = cand.gemv_tc35(xin, kernel_weight(w, "t"), natural_x=natural, bn=bn, gpi=gpi, split=split)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_dot_bound(out, x, w, u=U_TC, extra=1, what=f"tc{'5' if natural else '3'} {m}x{k}->{n} bn {bn} gpi {gpi}")


def test_tc35_refuses_what_it_cannot_read(gen):
    from ninfer.ops.triton._quant import kernel_weight

    x = randn(gen, 1, 640, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="whole 256-byte steps"):
        cand.gemv_tc35(x, kernel_weight(random_packed(gen, "q4_g64_fp16", 8, 640, DEVICE), "t"), natural_x=True)
    with pytest.raises(ValueError, match="q4_g64_fp16"):
        cand.gemv_tc35(x, kernel_weight(random_packed(gen, "q8_g32_fp16", 8, 640, DEVICE), "t"), natural_x=True)


@pytest.mark.parametrize("fmt,dec", sorted(cand8.ASM))
@pytest.mark.parametrize("perm", [0, 1])
def test_tc8_decode_variants_within_the_tensor_core_bound(fmt, dec, perm, gen):
    """Every 8-bit decode variant in both lane orders, at one row and at eight (fp8's x always 8 columns), with
    split-K: within the tensor-core bound of the oracle (on CUDA the variant's PTX runs)."""
    from ninfer.ops.triton._quant import kernel_weight

    k = 4096 if CUDA else 512
    w = random_packed(gen, fmt, 300 if CUDA else 40, k, DEVICE)
    for m in (1, 8):
        x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
        out = cand8.gemv_tc8(x, kernel_weight(w, "t"), dec=dec, perm=perm, split=2)
        assert_dot_bound(out, x, w, u=U_TC, extra=2, what=f"{fmt} dec {dec} perm {perm} rows {m}")
