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

pytest.importorskip("triton")
pytest.importorskip("transformers")

from models.qwen3_5 import harness as H  # noqa: E402

from .conftest import qwen_program  # noqa: E402


@pytest.fixture(scope="module")
def qwen_case(tmp_path_factory):
    return H.Cases(tmp_path_factory.mktemp("qwen3_5_triton"))


@pytest.mark.slow_interpreted
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_model_on_triton_ops_matches_reference_ops(qwen_case, name):
    case = qwen_case(name)
    triton_program = qwen_program(case, "triton")
    described = triton_program.model.ops.describe()
    for op in ("add_rms_norm_unit_offset_linear", "gdn_decode", "mrope_cos_sin", "linear"):
        assert described[op] == "triton", described
    H.assert_same_run(H.mixed_run(qwen_program(case, "reference")), H.mixed_run(triton_program), name)


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
    H.assert_same_run(H.mixed_run(qwen_program(case, "reference")), H.mixed_run(program), "flat")
