"""The Qwen3.5 Program: the SequenceProgram bookkeeping plus one varlen model call per unit.

A unit's decode rows (one token each) and its optional chunk are laid out as one token sequence,
decode rows first, and run through the model once: projections, norms and MLPs see all N tokens;
the GDN and attention cores split decode rows from the chunk (see ``layers``). Physical resources:
one :class:`PagedKVCache` over the full-attention layers and one :class:`StateImageStorage` slot
per sequence with the layout of :mod:`ninfer_qwen3_5.state`, plus (context cache) a checkpoint
storage of the same layout.
"""

from __future__ import annotations

import torch
from ninfer.core.kv_pool import PagedKVCache
from ninfer.core.state_image import StateImageStorage
from ninfer.runtime.contract.architecture import ProgramInit
from ninfer.runtime.sequence_program import ForwardBatch, SequenceProgram

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.model import Qwen35Model
from ninfer_qwen3_5.state import state_layout


class Qwen35Program(SequenceProgram):
    def __init__(self, init: ProgramInit) -> None:
        cfg = Qwen35Config.from_compact(init.config)
        opt = init.options
        device = torch.device(opt.device)
        kv = PagedKVCache(cfg.attention_layers, num_pages=opt.num_pages, page_size=opt.page_size,
                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=opt.dtype, device=device)
        layout = state_layout(cfg, opt.dtype)
        states = StateImageStorage(layout, opt.max_sequences, device)
        checkpoints = StateImageStorage(layout, opt.checkpoint_slots, device) if opt.checkpoint_slots else None
        super().__init__(vocab_size=cfg.vocab_size, kv=kv, states=states, ops=init.ops, device=device,
                         max_context=min(opt.max_context, cfg.max_position_embeddings), checkpoints=checkpoints)
        self.cfg = cfg
        self.dtype = opt.dtype
        self.model = Qwen35Model(cfg, init.weights, init.ops, device, opt.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        d, c = batch.decode, batch.chunk
        b_rows = len(d.seqs) if d is not None else 0
        t = int(c.tokens.shape[0]) if c is not None else 0
        parts = [x for x in (d, c) if x is not None]  # decode rows first, then the chunk
        tokens = torch.cat([x.tokens for x in parts])
        positions = torch.cat([x.positions for x in parts])
        slot_mapping = torch.cat([x.slot_mapping for x in parts])
        cos, sin = self.model.rotary(positions)
        dev = self.device
        ctx = StepContext(
            num_decode=b_rows, num_chunk=t, cos=cos, sin=sin, slot_mapping=slot_mapping,
            decode_slots=d.slots if d else None, decode_kv_lens=d.kv_lens if d else None,
            decode_page_tables=d.page_tables if d else None,
            chunk_slot=c.slot if c else None,
            chunk_cu_q=torch.tensor([0, t], dtype=torch.int32, device=dev) if c else None,
            chunk_kv_lens=torch.tensor([c.kv_len], dtype=torch.int32, device=dev) if c else None,
            chunk_page_table=c.page_table if c else None,
            kv=self.kv, states=self.states)
        if c is not None and c.all_logits:  # causal scoring: every chunk token predicts the next one
            rows = list(range(b_rows + t))
        else:
            rows = list(range(b_rows)) + ([b_rows + t - 1] if c is not None and c.want_logits else [])
        logit_rows = torch.tensor(rows, dtype=torch.int64, device=dev)
        return self.model.forward(tokens, ctx, logit_rows)
