"""The Qwen3.5 Program: its declared layout and one varlen model call per unit, on the ModelProgram base.

The base packs a unit's decode rows (one token each) and its chunks (of other sequences) into one token
sequence, decode rows first (:class:`~ninfer.program.batch.PackedBatch`), and captures and replays the
decode graphs; this call runs it through the model once: projections, norms, MLPs and the LM head see all
N tokens, the attention core runs the decode rows and then every chunk in one varlen call, and the GDN
core runs the decode rows, then each chunk on its own slot (see ``layers``). Physical resources,
declared in :func:`model_layout`: one paged KV pool per full-attention layer and one StateImage per
sequence with the layout of :mod:`ninfer_qwen3_5.state` (so the context cache's checkpoints too).

A decode step rewrites every field of the StateImage (each GDN layer's conv window and recurrent
state) in ``decode_out_slots``, so this architecture declares lookahead decode (``plugin.py``).
"""

from __future__ import annotations

import torch
from ninfer.contracts.architecture import ProgramInit
from ninfer.program.batch import PackedBatch
from ninfer.program.model import KVGeometry, ModelLayout, ModelProgram

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.model import Qwen35Model
from ninfer_qwen3_5.state import state_layout


def model_layout(cfg: Qwen35Config, dtype: torch.dtype) -> ModelLayout:
    return ModelLayout(vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                       kv=KVGeometry(tuple(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim),
                       state=state_layout(cfg, dtype))


class Qwen35Program(ModelProgram):
    def __init__(self, init: ProgramInit) -> None:
        cfg = Qwen35Config.from_compact(init.config)
        super().__init__(init, model_layout(cfg, init.options.dtype))
        self.cfg = cfg
        self.model = Qwen35Model(cfg, init.weights, init.ops, self.device, init.options.dtype)

    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        ctx = StepContext(
            num_decode=batch.num_decode, num_chunk=batch.num_chunk, positions=batch.positions, cos=None, sin=None,
            slot_mapping=batch.slot_mapping, decode_slots=batch.decode_slots, decode_out_slots=batch.decode_out_slots,
            decode_kv_lens=batch.decode_kv_lens, decode_page_tables=batch.decode_page_tables,
            chunk_slots=batch.chunk_slots, chunk_lens=batch.chunk_lens, chunk_cu_q=batch.chunk_cu_q,
            chunk_kv_lens=batch.chunk_kv_lens, chunk_page_tables=batch.chunk_page_tables, kv=self.kv,
            states=self.states)
        return self.model.forward(batch.tokens, ctx, batch.logit_rows)
