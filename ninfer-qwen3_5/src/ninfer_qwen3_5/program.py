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
from ninfer.contracts.architecture import ProgramInit
from ninfer.contracts.program import ProgramError
from ninfer.program.base import ForwardBatch, SequenceProgram
from ninfer.program.graphs import DecodeGraphs, HostTokens
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateImageStorage

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.model import Qwen35Model
from ninfer_qwen3_5.state import state_layout


class Qwen35Program(SequenceProgram):
    # A decode step rewrites every field of the StateImage (each GDN layer's conv window and recurrent
    # state) in the out slot, so lookahead decode may write spare slots.
    supports_lookahead = True

    def __init__(self, init: ProgramInit) -> None:
        cfg = Qwen35Config.from_compact(init.config)
        opt = init.options
        device = torch.device(opt.device)
        kv = PagedKVCache(cfg.attention_layers, num_pages=opt.num_pages, page_size=opt.page_size,
                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=opt.dtype, device=device)
        layout = state_layout(cfg, opt.dtype)
        states = StateImageStorage(layout, opt.max_sequences + opt.lookahead_slots, device)
        checkpoints = StateImageStorage(layout, opt.checkpoint_slots, device) if opt.checkpoint_slots else None
        super().__init__(vocab_size=cfg.vocab_size, kv=kv, states=states, ops=init.ops, device=device,
                         max_context=min(opt.max_context, cfg.max_position_embeddings), checkpoints=checkpoints,
                         lookahead_slots=opt.lookahead_slots)
        self.cfg = cfg
        self.dtype = opt.dtype
        self.model = Qwen35Model(cfg, init.weights, init.ops, device, opt.dtype)

        self.graphs: DecodeGraphs | None = None

    # -- CUDA graphs -----------------------------------------------------------------------------
    def capture_decode_graphs(self, max_batch: int) -> tuple[int, ...]:
        """Capture the decode-only forward for every batch size ``1..max_batch`` (CUDA only; see
        :mod:`ninfer.program.graphs`). Must run before any sequence exists: capture writes
        state slots ``0..max_batch-1`` and KV page 0. Returns the captured sizes."""
        if self._seqs:
            raise ProgramError("decode graphs must be captured before any sequence is opened")
        max_batch = min(max_batch, self.states.num_slots)
        graphs = DecodeGraphs(self._decode_forward, device=self.device, max_batch=max_batch,
                              max_pages=self.kv.pages_for(self.max_context), greedy=self.ops.greedy_tokens)
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs
        return graphs.batch_sizes

    def precomputed_greedy(self, logits: torch.Tensor) -> torch.Tensor | None:
        return self.graphs.greedy_for(logits) if self.graphs is not None else None

    def precomputed_host_tokens(self, tokens: torch.Tensor) -> HostTokens | None:
        return self.graphs.host_tokens_for(tokens) if self.graphs is not None else None

    def close_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    def _decode_forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        out_slots: torch.Tensor, kv_lens: torch.Tensor, page_tables: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """B decode rows, every row sampling: the graph-capturable forward (no host tensors, no syncs)."""
        ctx = StepContext(
            num_decode=int(tokens.shape[0]), num_chunk=0, positions=positions, cos=None, sin=None,
            slot_mapping=slot_mapping,
            decode_slots=slots, decode_out_slots=out_slots, decode_kv_lens=kv_lens, decode_page_tables=page_tables, chunk_slot=None,
            chunk_cu_q=None, chunk_kv_lens=None, chunk_page_table=None, kv=self.kv, states=self.states)
        return self.model.forward(tokens, ctx, None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        d, c = batch.decode, batch.chunk
        if c is None:
            if self.graphs is not None and self.graphs.has(len(d.seqs)):
                return self.graphs.run(d)
            return self._decode_forward(d.tokens, d.positions, d.slots, d.out_slots, d.kv_lens, d.page_tables,
                                        d.slot_mapping)
        b_rows = len(d.seqs) if d is not None else 0
        t = int(c.tokens.shape[0]) if c is not None else 0
        parts = [x for x in (d, c) if x is not None]  # decode rows first, then the chunk
        tokens = torch.cat([x.tokens for x in parts])
        positions = torch.cat([x.positions for x in parts])
        slot_mapping = torch.cat([x.slot_mapping for x in parts])
        dev = self.device
        ctx = StepContext(
            num_decode=b_rows, num_chunk=t, positions=positions, cos=None, sin=None, slot_mapping=slot_mapping,
            decode_slots=d.slots if d else None, decode_out_slots=d.out_slots if d else None,
            decode_kv_lens=d.kv_lens if d else None,
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
