"""ModelProgram: the Program an architecture subclasses. It supplies two things and nothing else:

- its physical layout, declared as a :class:`ModelLayout` (vocabulary, position limit, the geometry of
  its paged KV pools, its StateImage layout), passed to ``ModelProgram.__init__``, which allocates the
  KV pool, the sequences' StateImage slots (plus the lookahead spares) and the checkpoint slots;
- its model call, :meth:`ModelProgram.forward_packed`, over a :class:`~ninfer.program.batch.PackedBatch`.

Everything else is here or in :class:`~ninfer.program.base.SequenceProgram`: packing a unit's decode
rows and chunks into one token sequence (:func:`~ninfer.program.batch.pack_batch`), the decode CUDA
graphs (:mod:`~ninfer.program.graphs`) and the choice between replaying one and the eager call.

Invariants:
- ``forward_packed`` on a decode-only batch (``num_chunk == 0``, ``logit_rows`` None) is
  graph-capturable: no host tensors, no synchronisation, nothing that depends on tensor *values* on
  the host. Decode graphs capture exactly that call, so the eager and the graphed decode step run the
  same kernels on the same inputs.
- A decode-only unit replays the graph of its exact batch size when one was captured, else runs
  eagerly; a unit with chunks replays the smallest prefill graph that holds it laid out flat (when they were
  captured: ``prefill_graphs``), else runs eagerly.
- Lookahead decode (``ProgramOptions.lookahead_slots``, given only when ``ArchitectureSpec.lookahead``
  is declared): ``forward_packed`` reads each decode row's state from ``decode_slots`` and writes every
  StateImage field of ``decode_out_slots``.
- Decode graphs are captured before any sequence exists (capture writes state slots and KV page 0).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass

import torch

from ninfer.contracts.architecture import ProgramInit
from ninfer.contracts.program import ProgramError, WarmupLimits, WarmupSummary
from ninfer.program.base import SequenceProgram
from ninfer.program.batch import ForwardBatch, HostTokens, PackedBatch, pack_batch
from ninfer.program.graphs import DecodeGraphs
from ninfer.program.prefill_graphs import PrefillGraphs
from ninfer.storage.kv_pool import PagedKVCache, SidePool
from ninfer.storage.state_image import StateImageStorage, StateLayout


@dataclass(frozen=True)
class KVGeometry:
    """The paged KV pools: one K and one V pool of ``[num_pages, page_size, num_kv_heads, head_dim]`` (in the
    activation dtype) per layer in ``layers`` (the layers that attend over the whole history; empty: none).
    ``own``: ``(layer, num_kv_heads, head_dim)`` of layers whose pools have a geometry of their own (e.g. a
    speculative drafter's layers); each must be in ``layers``. ``side``: per-token pools of their own geometry
    under the same page tables (:class:`SidePool`)."""

    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    own: tuple[tuple[int, int, int], ...] = ()
    side: tuple[SidePool, ...] = ()


@dataclass(frozen=True)
class ModelLayout:
    """What an architecture declares about its physical state. ``max_positions``: the model's own
    position limit (the Program's ``max_context`` is the smaller of it and ``ProgramOptions.max_context``).
    ``state``: one sequence's StateImage (its recurrent state; no fields: none), zeroed when allocated."""

    vocab_size: int
    max_positions: int
    kv: KVGeometry
    state: StateLayout


class ModelProgram(SequenceProgram):
    """A SequenceProgram whose ``forward`` is the architecture's :meth:`forward_packed` (see the module
    docstring). ``graphs``: the captured decode graphs, or None; ``prefill_graphs``: the captured prefill-step
    graphs, or None; ``host_expert_kernel``: with host experts, the kernel the host computes them with as the
    architecture resolved ``StartupFeatures.host_expert_kernel`` ("torch", "compiled" or "native"; never "auto"),
    else None (``Engine.info["host_expert_kernel"]``); ``host_expert_threads``: the host threads it computes with
    as resolved (None: torch's own count; ``Engine.info["host_expert_threads"]``).

    ``flat_steps`` (class attribute): the architecture's :meth:`forward_packed` runs padded flat calls
    (:mod:`ninfer.program.flat_batch`) without reading anything of them on the host, so its steps that prefill can
    be captured (``ProgramOptions.prefill_graph_tokens``)."""

    flat_steps = False

    def __init__(self, init: ProgramInit, layout: ModelLayout) -> None:
        opt = init.options
        device = torch.device(opt.device)
        kv = PagedKVCache(layout.kv.layers, num_pages=opt.num_pages, page_size=opt.page_size,
                          num_kv_heads=layout.kv.num_kv_heads, head_dim=layout.kv.head_dim, dtype=opt.dtype,
                          device=device, geometry={layer: (h, d) for layer, h, d in layout.kv.own},
                          side=layout.kv.side)
        # Prefill graphs hold one more slot, the one their padded rows share (never a sequence's).
        self._prefill_tokens = opt.prefill_graph_tokens if self.flat_steps else ()
        spare = 1 if self._prefill_tokens else 0
        states = StateImageStorage(layout.state, opt.max_sequences + opt.lookahead_slots + spare, device)
        checkpoints = StateImageStorage(layout.state, opt.checkpoint_slots, device) if opt.checkpoint_slots else None
        super().__init__(vocab_size=layout.vocab_size, kv=kv, states=states, ops=init.ops, device=device,
                         max_context=min(opt.max_context, layout.max_positions), checkpoints=checkpoints,
                         lookahead_slots=opt.lookahead_slots, dtype=opt.dtype)
        self.layout = layout
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.prefill_graphs_s = 0.0   # seconds the prefill graphs' capture took (Engine.info["startup"])
        self.host_expert_kernel: str | None = None
        self.host_expert_threads: int | None = None
        self._pad_slot = self.states.allocate() if spare else None
        self.held_state_slots = spare

    # -- the architecture ------------------------------------------------------------------------
    @abstractmethod
    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        """The model call over ``batch``, updating the KV pools and StateImage slots in place. Returns fp32
        logits ``[R, vocab]`` of the tokens ``batch.logit_rows`` names, in order (every token when None)."""

    # -- the forward SequenceProgram calls -------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        d = batch.decode
        if not batch.chunks:
            if self.graphs is not None and self.graphs.has(len(d.seqs)):
                return self.graphs.run(d)
            return self._decode_forward(d.tokens, d.positions, d.slots, d.out_slots, d.kv_lens, d.page_tables,
                                        d.slot_mapping)
        bucket = self.prefill_graphs.bucket_for(batch) if self.prefill_graphs is not None else None
        if bucket is not None:
            return self.prefill_graphs.run(batch, bucket)
        return self.forward_packed(pack_batch(batch, self.device))

    def _decode_forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        out_slots: torch.Tensor, kv_lens: torch.Tensor, page_tables: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """B decode rows, every row sampling: the graph-capturable call (a :data:`~ninfer.program.graphs.
        DecodeForward`), eager or captured."""
        return self.forward_packed(PackedBatch.decode_only(tokens, positions, slots, out_slots, kv_lens,
                                                           page_tables, slot_mapping))

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
        if self._prefill_tokens:
            self.capture_prefill_graphs(self._prefill_tokens)
        return graphs.batch_sizes

    def capture_prefill_graphs(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """Capture the flat-step forward for each token bucket (CUDA, an architecture with ``flat_steps``; see
        :mod:`ninfer.program.prefill_graphs`), rows for every sequence the Program holds and pages for its
        max_context. Before any sequence exists. Returns the buckets."""
        if self._seqs:
            raise ProgramError("prefill graphs must be captured before any sequence is opened")
        if not self.flat_steps or self._pad_slot is None:
            raise ProgramError(f"{type(self).__name__} does not run flat steps (or holds no slot for their padded "
                               f"rows): no prefill graphs")
        started = time.perf_counter()
        graphs = PrefillGraphs(self.forward_packed, device=self.device, buckets=tuple(buckets),
                               rows=self.states.num_slots, pages=self.kv.pages_for(self.max_context),
                               pad_state_slot=self._pad_slot)
        with torch.inference_mode():
            graphs.capture()
        self.prefill_graphs = graphs
        self.prefill_graphs_s = time.perf_counter() - started
        return graphs.buckets

    def warm_up(self, limits: WarmupLimits) -> WarmupSummary:
        """The warm-up with the prefill-step graphs set aside: a step that fits a bucket may still run eagerly while
        serving (a verify or scoring chunk, a lookahead's decode rows; :func:`~ninfer.program.flat_batch.flat_needs`),
        so the warm-up compiles the eager step's variants for every shape; the graphs' own were compiled by their
        capture, and replaying one compiles nothing."""
        graphs, self.prefill_graphs = self.prefill_graphs, None
        try:
            return super().warm_up(limits)
        finally:
            self.prefill_graphs = graphs

    def precomputed_greedy(self, logits: torch.Tensor) -> torch.Tensor | None:
        return self.graphs.greedy_for(logits) if self.graphs is not None else None

    def precomputed_host_tokens(self, tokens: torch.Tensor) -> HostTokens | None:
        return self.graphs.host_tokens_for(tokens) if self.graphs is not None else None

    def close_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.close()
            self.prefill_graphs = None
