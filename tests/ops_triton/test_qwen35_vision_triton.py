"""The Qwen3.5 Program with the vision tower on the Triton ops against the same Program on the torch reference
ops (a tiny random checkpoint of tests/models/qwen3_5/vision_harness.py, fp32; on the CPU under
TRITON_INTERPRET=1): the MRoPE table kernel on three distinct position axes, media rows over the placeholders,
decode rows at index + delta. On CUDA, also with decode graphs captured: a graph reads each row's rope delta from
its StateImage on the device, and must equal the eager steps bitwise.

Criterion: the same greedy tokens, every sampled row's logits within 1e-4 (max abs, fp32; kernels reorder sums).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from models.qwen3_5 import harness as H  # noqa: E402
from models.qwen3_5 import vision_harness as V  # noqa: E402

from .conftest import CUDA, DEVICE, kernel_impls, reference_impls  # noqa: E402


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return V.build_case("dense", tmp_path_factory.mktemp("qwen3_5_vision_triton"), seed=21)


def _program(case, ops_kind: str):
    from ninfer.contracts.architecture import ProgramInit, ProgramOptions
    from ninfer.contracts.features import StartupFeatures
    from ninfer.ops import resolve_ops

    impls = reference_impls() + (kernel_impls() if ops_kind == "triton" else [])
    ops = resolve_ops(impls, DEVICE, torch.float32, force="reference" if ops_kind == "reference" else "")
    options = ProgramOptions(device=torch.device(DEVICE), dtype=torch.float32, max_sequences=4, page_size=4,
                             num_pages=128, max_context=256)
    weights = {k: v.to(DEVICE) for k, v in case.weights.items()}
    return case.spec.create_program(ProgramInit(config=case.config, weights=weights, ops=ops, options=options,
                                                features=StartupFeatures(vision=True)))


def _run(program) -> tuple[dict[int, list[torch.Tensor]], list[dict[int, int]]]:
    """A text prompt, then an image prompt prefilled in chunks of 6 beside the text's decode rows, then an
    image-and-video prompt in one chunk beside both, then all three decoding together."""
    r = H.Runner(program)
    a = V.media_prompt([1, 2, ("image", (1, 6, 10)), 3], seed=1)
    b = V.media_prompt([4, ("image", (1, 4, 4)), 5, ("video", (2, 4, 4)), 6], seed=2)
    t = r.open(H.prompt(3, 7))
    sa = program.open_sequence(a.tokens, media=a.media)
    sb = program.open_sequence(b.tokens, media=b.media)
    tokens = [r.unit(chunk=(t, 7))]
    tokens += [r.unit(decode=[t], chunk=(sa, k)) for k in H.split(len(a.tokens), 6)]
    tokens.append(r.unit(decode=[t, sa], chunk=(sb, len(b.tokens))))
    tokens += [r.unit(decode=[t, sa, sb]) for _ in range(3)]
    tokens += [r.unit(decode=[sa, sb]) for _ in range(2)]
    return r.logits, tokens


def _same(ref, got, tol: float) -> None:
    ref_logits, ref_tokens = ref
    got_logits, got_tokens = got
    assert got_tokens == ref_tokens
    for seq, rows in ref_logits.items():
        for i, (want, have) in enumerate(zip(rows, got_logits[seq], strict=True)):
            err = (have.float().cpu() - want.float().cpu()).abs().max().item()
            assert err <= tol, f"sequence {seq} row {i} logits differ by {err:.2e}"


@pytest.mark.slow_interpreted
def test_vision_program_on_triton_ops_matches_reference_ops(case):
    program = _program(case, "triton")
    assert program.model.ops.describe()["mrope_cos_sin"] == "triton"
    _same(_run(_program(case, "reference")), _run(program), 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="decode graphs need a CUDA device")
def test_decode_graphs_read_the_rope_delta_like_the_eager_steps(case):
    eager = _run(_program(case, "triton"))
    graphed = _program(case, "triton")
    assert graphed.capture_decode_graphs(3) == (1, 2, 3)
    _same(eager, _run(graphed), 0.0)
