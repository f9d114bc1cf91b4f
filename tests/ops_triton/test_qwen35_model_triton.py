"""The Qwen3.5 model on the Triton ops against the same model on the torch reference ops (tiny random
checkpoints of tests/models/qwen3_5, fp32; on the CPU under TRITON_INTERPRET=1).

The op suites check each kernel alone; this checks the layer plumbing of the paths only the Triton ops take:
``add_rms_norm_unit_offset_linear``'s fused GEMV for one decode row (its stored normed row and residual feed the rest of the
block and the next block), ``gdn_decode`` on the layers' real column views and slots, the attention projections
through ``row_groups``, the (M)RoPE table kernel. Criterion: every sampled row's logits within 1e-4 of the
reference run's (max abs, fp32; the kernels reorder fp32 sums) and the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from models.qwen3_5 import harness as H  # noqa: E402

from .conftest import qwen_program  # noqa: E402


@pytest.fixture(scope="module")
def qwen_case(tmp_path_factory):
    return H.Cases(tmp_path_factory.mktemp("qwen3_5_triton"))


def _run(program) -> tuple[dict[int, list[torch.Tensor]], list[dict[int, int]]]:
    """Three sequences: prefill one, decode it alone (one row: the fused paths), prefill the second and the
    third in one unit beside a decode row of the first (a mixed unit of two chunks), then decode all three
    together (three rows)."""
    r = H.Runner(program)
    a, b, c = r.open(H.prompt(1, 9)), r.open(H.prompt(2, 7)), r.open(H.prompt(3, 5))
    tokens = [{a: r.prefill(a)}]
    tokens += [r.unit(decode=[a]) for _ in range(2)]
    tokens.append(r.unit(decode=[a], chunks=[(b, 7), (c, 5)]))
    tokens += [r.unit(decode=[a, b, c]) for _ in range(2)]
    return r.logits, tokens


@pytest.mark.slow_interpreted
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_model_on_triton_ops_matches_reference_ops(qwen_case, name):
    case = qwen_case(name)
    triton_program = qwen_program(case, "triton")
    described = triton_program.model.ops.describe()
    for op in ("add_rms_norm_unit_offset_linear", "gdn_decode", "mrope_cos_sin", "linear"):
        assert described[op] == "triton", described
    ref_logits, ref_tokens = _run(qwen_program(case, "reference"))
    tri_logits, tri_tokens = _run(triton_program)
    assert tri_tokens == ref_tokens
    for seq, rows in ref_logits.items():
        for i, (want, got) in enumerate(zip(rows, tri_logits[seq], strict=True)):
            err = (got.float().cpu() - want.float().cpu()).abs().max().item()
            assert err <= 1e-4, f"{name}: sequence {seq} row {i} logits differ by {err:.2e}"


@pytest.mark.slow_interpreted
def test_a_flat_padded_step_on_triton_ops_matches_reference_ops(qwen_case):
    """The flat, padded layout of prefill and mixed-step graphs (:mod:`ninfer.program.flat_batch`) on the Triton
    kernels (the varlen GDN ops, padded rows and tokens) against the ordinary layout on the reference ops."""
    from ninfer.program.flat_batch import FlatSizes, pack_flat

    case = qwen_case("moe")
    program = qwen_program(case, "triton")
    page = program.kv.allocator.allocate(1)[0]
    pad_state = program.states.allocate()

    def flat(batch):
        packed = pack_flat(batch, program.device, FlatSizes(tokens=40, rows=6, pages=8, logit_rows=6,
                                                            pad_kv_slot=page * program.kv.page_size,
                                                            pad_state_slot=pad_state))
        return program.forward_packed(packed)[:batch.num_logit_rows]

    program.forward = flat
    ref_logits, ref_tokens = _run(qwen_program(case, "reference"))
    got_logits, got_tokens = _run(program)
    assert got_tokens == ref_tokens
    for seq, rows in ref_logits.items():
        for i, (want, got) in enumerate(zip(rows, got_logits[seq], strict=True)):
            err = (got.float().cpu() - want.float().cpu()).abs().max().item()
            assert err <= 1e-4, f"flat: sequence {seq} row {i} logits differ by {err:.2e}"
