"""The Qwen4-Exp Program: its declared layout (:mod:`ninfer_qwen4exp.state`) and one model call per unit, on the
ModelProgram base.

The base packs a unit's decode rows and chunks into one token sequence; this call runs it through the model once
(:mod:`ninfer_qwen4exp.model`). Everything a sequence carries between steps lives in the base's structures: each
GDN layer's conv and recurrent state, each PLE layer's conv history and the n-gram context in the sequence's
StateImage; each indexed-attention layer's K/V and its indexer's per-token keys and rotary angles in the paged KV
(a side pool under the same page tables). Chunked prefill, batching, pause with Replay or Snapshot, and the
context cache's checkpoints (a StateImage copy plus a shared KV prefix) therefore carry all of it with no code here.

Not yet: speculative decoding (``ProgramOptions.speculative_tokens`` must be 0), decode CUDA graphs (the reference
QSA and PLE ops read row metadata on the host, so every step runs eagerly) and lookahead decode (not declared).
"""

from __future__ import annotations

import torch
from ninfer.contracts.architecture import ProgramInit
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import PackedBatch
from ninfer.program.model import ModelProgram
from ninfer_qwen3_5.layers.context import StepContext

from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.model import Qwen4ExpModel
from ninfer_qwen4exp.state import model_layout


class Qwen4ExpProgram(ModelProgram):
    def __init__(self, init: ProgramInit) -> None:
        cfg = Qwen4ExpConfig.from_compact(init.config)
        if init.options.speculative_tokens:
            raise ProgramError("Qwen4-Exp does not support speculative decoding yet "
                               f"(speculative_tokens={init.options.speculative_tokens!r})")
        super().__init__(init, model_layout(cfg, init.options.dtype))
        self.cfg = cfg
        self.model = Qwen4ExpModel(cfg, init.weights, init.ops, self.device, init.options.dtype)

    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        if batch.has_verify:
            raise ProgramError("Qwen4-Exp does not support speculative verify chunks yet")
        ctx = StepContext(
            num_decode=batch.num_decode, num_chunk=batch.num_chunk, positions=batch.positions, cos=None, sin=None,
            slot_mapping=batch.slot_mapping, decode_slots=batch.decode_slots, decode_out_slots=batch.decode_out_slots,
            decode_kv_lens=batch.decode_kv_lens, decode_page_tables=batch.decode_page_tables,
            chunk_slots=batch.chunk_slots, chunk_lens=batch.chunk_lens, chunk_cu_q=batch.chunk_cu_q,
            chunk_kv_lens=batch.chunk_kv_lens, chunk_page_tables=batch.chunk_page_tables, kv=self.kv,
            states=self.states)
        return self.model.forward(batch.tokens, ctx, batch.logit_rows)

    def capture_decode_graphs(self, max_batch: int) -> tuple[int, ...]:
        return ()   # the reference QSA and PLE ops synchronise with the host: no graph can hold them
