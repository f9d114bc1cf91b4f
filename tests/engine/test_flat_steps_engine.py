"""The engine with its steps that prefill taken through ``ModelProgram.prefill_graphs`` (the flat padded layout of
``--prefill-graphs``), on the CPU: a stand-in with the graphs' interface runs each such step eagerly through
``pack_flat`` (the captured graphs need CUDA; tests/engine/test_engine_gpu.py replays the real ones). A burst of 8
prompts, chunked across steps beside decoding requests, gives each request's tokens alone on the tiny Qwen3.5 (fp32
reference ops), so the Program's dispatch, the flat layout of mixed steps and the engine's use of their logits agree
with the ordinary path."""

from __future__ import annotations

from ninfer.program.flat_batch import FlatSizes, flat_needs, pack_flat

from .test_multi_prefill import BURST, alone, burst, qwen_work, start


class EagerFlatSteps:
    """``PrefillGraphs``' interface (bucket_for, run, replays) over :func:`pack_flat`, run eagerly."""

    def __init__(self, program, tokens: int) -> None:
        self.program = program
        page = program.kv.allocator.allocate(1)[0]   # where padded tokens write (the CPU KV writes check range)
        self.sizes = FlatSizes(tokens=tokens, rows=program.states.num_slots, pages=program.kv.pages_for(
            program.max_context), logit_rows=program.states.num_slots, pad_kv_slot=page * program.kv.page_size,
            pad_state_slot=program.states.allocate())
        self.replays = 0

    def bucket_for(self, batch):
        return self.sizes if self.sizes.holds(flat_needs(batch)) else None

    def run(self, batch, sizes=None):
        self.replays += 1
        packed = pack_flat(batch, self.program.device, self.sizes)
        return self.program.forward_packed(packed)[:batch.num_logit_rows]


def test_a_burst_through_flat_steps_equals_each_request_alone(tiny_qwen_artifact):
    work = qwen_work(BURST, seed=7)
    expected = alone(tiny_qwen_artifact, work)
    with start(tiny_qwen_artifact, max_concurrency=8, prefill_chunk_size=16, max_step_tokens=12) as engine:
        program = engine._program  # noqa: SLF001
        flat = program.prefill_graphs = EagerFlatSteps(program, tokens=16)
        assert burst(engine, program, work) == expected
        assert flat.replays > 0 and engine.stats().max_unit_chunks >= 2
