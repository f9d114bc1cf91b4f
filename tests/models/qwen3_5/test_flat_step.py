"""A step laid out flat and padded (:mod:`ninfer.program.flat_batch`, the layout of prefill and mixed-step graphs)
against the ordinary layout, on the torch reference ops in fp32: the same logits (the decode rows' recurrence then
runs in its chunked form, so within fp32 summation order) and the same greedy tokens, over a prefill alone, decode
rows, a mixed unit of a decode row and two chunks, and three decode rows (``harness.mixed_run``); the padded tokens
and rows leave every sequence's KV and state alone (the second program's later steps would diverge otherwise)."""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import ForwardBatch
from ninfer.program.flat_batch import FlatSizes, flat_needs, pack_flat

from . import harness as H

SIZES = {"tokens": 40, "rows": 6, "pages": 8, "logit_rows": 6}


def _flat(program):
    """``program`` with every forward laid out flat and padded to SIZES."""
    page = program.kv.allocator.allocate(1)[0]   # the padded tokens' KV slot: a page no sequence holds
    sizes = FlatSizes(**SIZES, pad_kv_slot=page * program.kv.page_size, pad_state_slot=program.states.allocate())

    def forward(batch: ForwardBatch):
        return program.forward_packed(pack_flat(batch, program.device, sizes))[:batch.num_logit_rows]

    program.forward = forward
    return program


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_a_flat_padded_step_equals_the_ordinary_layout(qwen_case, name):
    case = qwen_case(name)
    H.assert_same_run(H.mixed_run(H.make_program(case)), H.mixed_run(_flat(H.make_program(case))), name)


def test_a_step_that_does_not_fit_the_flat_sizes_is_refused(qwen_case):
    program = H.make_program(qwen_case("dense"))
    seqs = [program.open_sequence(H.prompt(s, 30)) for s in (1, 2)]
    seen = {}

    def forward(batch: ForwardBatch):
        seen["sizes"] = flat_needs(batch)
        sizes = FlatSizes(**SIZES, pad_kv_slot=0, pad_state_slot=0)
        assert not sizes.holds(flat_needs(batch))
        with pytest.raises(ProgramError, match="does not fit the flat sizes"):
            pack_flat(batch, program.device, sizes)
        raise RuntimeError("checked")

    program.forward = forward
    r = H.Runner(program, record=False)
    with pytest.raises(RuntimeError, match="checked"):
        r.unit(chunks=[(seqs[0], 30), (seqs[1], 30)])
    assert seen["sizes"] == (60, 2, 8, 2)   # 60 tokens > 40


def test_prefill_graphs_hold_one_state_slot_outside_the_capacity(qwen_case):
    import dataclasses

    from ninfer.contracts.architecture import ProgramInit, ProgramOptions
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    case = qwen_case("dense")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=3, page_size=4,
                             num_pages=64, max_context=128, prefill_graph_tokens=(16, 32))
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")

    def program(opts):
        return case.spec.create_program(ProgramInit(config=case.config, weights=case.weights, ops=ops, options=opts))

    graphed, plain = program(options), program(dataclasses.replace(options, prefill_graph_tokens=()))
    assert graphed.states.num_slots == plain.states.num_slots + 1
    for p in (graphed, plain):
        cap = p.capacity()
        assert cap.total_state_slots == cap.free_state_slots == 3
    with pytest.raises(ValueError, match="CUDA"):   # the graphs themselves need a CUDA device
        graphed.capture_prefill_graphs((16,))
    assert graphed.flat_steps


def test_no_flat_steps_beside_host_experts(qwen_case):
    from ninfer.contracts.architecture import ProgramInit, ProgramOptions, StartupFeatures
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    case = qwen_case("moe")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=3, page_size=4,
                             num_pages=64, max_context=128, prefill_graph_tokens=(16,))
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    program = case.spec.create_program(ProgramInit(config=case.config, weights=case.weights, ops=ops, options=options,
                                                   features=StartupFeatures(host_experts=True)))
    assert not program.flat_steps and program.states.num_slots == 3   # no slot held, nothing to capture
    with pytest.raises(ProgramError, match="does not run flat steps"):
        program.capture_prefill_graphs((16,))
