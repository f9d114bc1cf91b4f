"""The persistent-decode probe of tools/gpu_persistent_probe.py: a stack of dense SwiGLU MLP blocks in one kernel whose
phases meet at device-side grid barriers. Every mode runs the same arithmetic, so the phase-per-launch form
(``split``), one persistent launch per block (``layer``) and one for the whole stack (``chain``) must agree bitwise,
and all equal the fp32 torch stack with the kernels' roundings within bf16's rounding of each block's output.
Under the interpreter programs run one after another, so the persistent forms run with one program (their barrier
then passes at once, the counter and its reset still run); on CUDA with as many programs as the device holds, which
is the barrier's real test, run twice so that the counter's reset between launches is exercised."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from .conftest import CUDA, DEVICE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gpu_persistent_probe as probe  # noqa: E402

# (hidden, intermediate, blocks): an intermediate that is no multiple of the tiles, and one with several K chunks
# of the down projection when on CUDA (I > 4096).
CASES = [(64, 96, 2), (48, 40, 3)]
if CUDA:
    CASES += [(1024, 3584, 3), (256, 5000, 2)]


def _programs() -> list[int]:
    if not CUDA:
        return [1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [1, 7, sms]


def _run(stack: probe.MLPStack, mode: str, programs: int = 1) -> torch.Tensor:
    stack.xs[1:].zero_()
    stack.res[1:].zero_()
    stack.act.zero_()
    getattr(stack, mode)(*(() if mode == "split" else (programs,)))
    return stack.xs.clone(), stack.res.clone()


@pytest.mark.parametrize(("hidden", "inter", "blocks"), CASES)
def test_every_mode_computes_the_same_stack(hidden, inter, blocks):
    stack = probe.MLPStack(hidden, inter, blocks, DEVICE, torch.bfloat16, seed=3)
    ref = stack.reference()
    xs, res = _run(stack, "split")
    out = xs[blocks].float()
    # One bf16 rounding of the output plus the reductions' order: a few units of bf16 at the output's scale.
    assert (out - ref).abs().max() <= 2 ** -6 * ref.abs().max()
    assert torch.equal(res[1], (stack.xs[0].float() + stack.res[0].float()).to(torch.bfloat16))
    for programs in _programs():
        for mode in ("layer", "chain"):
            for _ in range(2):   # the second launch starts from the counter the first one reset
                got_xs, got_res = _run(stack, mode, programs)
                assert torch.equal(got_xs, xs), (mode, programs)
                assert torch.equal(got_res, res), (mode, programs)
                assert stack.bar.tolist() == [0, 0]


@pytest.mark.parametrize("rows", [4, 8])
def test_wider_tiles_compute_the_same_stack(rows):
    # --rows: more rows a tile, the same dots. Under the interpreter the row sums come out bitwise equal; on CUDA
    # a tile's shape may change the order of its in-register reduction, so there within one bf16 rounding.
    stack = probe.MLPStack(64, 96, 2, DEVICE, torch.bfloat16, seed=4)
    want, _ = _run(stack, "split")
    stack.rows = rows
    for mode in ("split", "layer", "chain"):
        got, _ = _run(stack, mode, _programs()[-1])
        if CUDA:
            assert (got[2].float() - want[2].float()).abs().max() <= 2 ** -7 * want[2].float().abs().max()
        else:
            assert torch.equal(got, want), (mode, rows)
        assert stack.bar.tolist() == [0, 0]


def test_the_barrier_only_kernel_resets_its_counter():
    bar = torch.zeros(2, device=DEVICE, dtype=torch.int32)
    for _ in range(2):
        probe._sync_kernel[(_programs()[-1],)](bar, SYNCS=5, PDL=False)
        assert bar.tolist() == [0, 0]


def test_the_stack_matches_todays_ops_on_cuda():
    if not CUDA:
        pytest.skip("today's fused GEMVs take the GEMV path only on CUDA (the interpreter's op set falls back)")
    stack = probe.MLPStack(1024, 3584, 3, DEVICE, torch.bfloat16, seed=5)
    xs, _ = _run(stack, "split")
    stack.xs[1:].zero_()
    stack.ops()
    ops = stack.xs[3].float()
    assert (xs[3].float() - ops).abs().max() <= 2 ** -6 * ops.abs().max()
