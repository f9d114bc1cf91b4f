"""What one model call receives: the unit's rows addressed into the KV pool and StateImage slots.

A leaf module (it imports nothing else from :mod:`ninfer.program`), shared by the bookkeeping
(:mod:`~ninfer.program.base`), the decode graphs (:mod:`~ninfer.program.graphs`) and lookahead
decode (:mod:`~ninfer.program.lookahead`).

- :class:`ForwardBatch`: the unit as the bookkeeping prepared it: :class:`DecodeRows` (B decode rows,
  one token each, described on the host) and at most one :class:`ChunkRows` (T ledger tokens of one
  sequence, already on the device).
- :class:`PackedBatch`: the same unit laid out as one token sequence of N = B + T tokens, decode rows
  first, then the chunk: what an architecture's model call reads (:func:`pack_batch` builds it).

Invariants: a decode row's token is at position ``at[b]`` and its KV length is ``at[b] + 1``; a
chunk covers ledger tokens ``[start, start + T)`` and its KV length is ``start + T``; the logits a
call returns are those of :attr:`ForwardBatch.num_logit_rows` rows, decode rows in order, then the
chunk's last token (every chunk token, in order, when ``all_logits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ninfer.contracts.program import ProgramError, SeqId


def to_device(data: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data onto ``device`` without waiting for the stream: a pinned buffer and a non-blocking copy
    on CUDA (a pageable copy would synchronise with a queued lookahead step); a plain tensor elsewhere."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class HostTokens:
    """One decode-graph replay's greedy tokens on their way to the host: ``ring[row, :b]`` (pinned, written
    by the graph's greedy kernel) once ``ready`` (an event recorded after the replay) has completed.

    Invariant: :meth:`values` always answers the tokens of *this* replay. The owner
    (:class:`~ninfer.program.graphs.DecodeGraphs`) calls :meth:`keep` before it replays a graph into the
    same ring row again; keep waits for this replay and copies the row out, so later readers get the copy."""

    def __init__(self, ring_row: torch.Tensor, ready: torch.cuda.Event) -> None:
        self._row = ring_row
        self._ready = ready
        self._kept: list[int] | None = None

    def keep(self) -> None:
        if self._kept is None:
            self._ready.synchronize()
            self._kept = [int(t) for t in self._row.tolist()]

    def values(self) -> list[int]:
        """The tokens (waits for the replay, not for anything queued after it)."""
        self.keep()
        return list(self._kept)


@dataclass(frozen=True)
class DecodeRows:
    """B decode rows, one token each (the last ledger token), described on the host.

    ``at[b]`` is the row's computed count (its token's position; its kv length is ``at[b] + 1``);
    ``state_slots`` the StateImage slots the rows read and ``state_out_slots`` those their new state
    is written to (the same, except in a lookahead step, which writes spare slots); ``kv_slots[b]``
    the flat KV slot of the row's token; ``pages[b]`` the row's pages covering ``at[b] + 1`` tokens.
    The tokens are on the host (``token_ids``) or already on the device (``device_tokens``, int64
    [B], drawn there): exactly one of the two.

    The device tensors (``tokens``, ``positions``, ``slots``, ``out_slots``, ``kv_lens``,
    ``page_tables``, ``slot_mapping``) are made on first use, from the host description, in
    non-blocking pinned copies. A decode graph reads the host description instead and copies it
    straight into its static inputs (:meth:`~ninfer.program.graphs.DecodeGraphs.run`), so a
    graphed step makes none of them."""

    seqs: tuple[SeqId, ...]
    device: torch.device
    at: tuple[int, ...]
    state_slots: tuple[int, ...]
    state_out_slots: tuple[int, ...]
    kv_slots: tuple[int, ...]
    pages: tuple[Sequence[int], ...]
    token_ids: tuple[int, ...] | None = None
    device_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = len(self.seqs)
        if not all(len(f) == b for f in (self.at, self.state_slots, self.state_out_slots, self.kv_slots,
                                          self.pages)):
            raise ProgramError(f"decode rows of {b} sequences need one position, slot, out slot, KV slot and "
                               f"page list per row")
        if (self.token_ids is None) == (self.device_tokens is None):
            raise ProgramError("decode rows take their tokens from the host or from the device: exactly one")
        n = len(self.token_ids) if self.token_ids is not None else int(self.device_tokens.shape[0])
        if n != b:
            raise ProgramError(f"decode rows of {b} sequences got {n} tokens")

    @cached_property
    def tokens(self) -> torch.Tensor:   # int64 [B]
        if self.device_tokens is not None:
            return self.device_tokens
        return to_device(list(self.token_ids), torch.int64, self.device)

    @cached_property
    def _meta(self) -> torch.Tensor:    # int64 [4, B]: positions, slots, out slots, KV slots
        return to_device([list(self.at), list(self.state_slots), list(self.state_out_slots), list(self.kv_slots)],
                         torch.int64, self.device)

    @cached_property
    def _tables(self) -> torch.Tensor:  # int32 [B + B * width]: kv lengths, then the page table's rows
        width = max(1, max((len(p) for p in self.pages), default=1))
        flat = [a + 1 for a in self.at]
        for p in self.pages:
            flat.extend(p)
            flat.extend([0] * (width - len(p)))   # never read: kernels stop at the row's kv length
        return to_device(flat, torch.int32, self.device)

    @property
    def positions(self) -> torch.Tensor:     # int64 [B]
        return self._meta[0]

    @property
    def slots(self) -> torch.Tensor:         # int64 [B]
        return self._meta[1]

    @property
    def out_slots(self) -> torch.Tensor:     # int64 [B]
        return self._meta[2]

    @property
    def slot_mapping(self) -> torch.Tensor:  # int64 [B]
        return self._meta[3]

    @property
    def kv_lens(self) -> torch.Tensor:       # int32 [B]
        return self._tables[: len(self.seqs)]

    @property
    def page_tables(self) -> torch.Tensor:   # int32 [B, width]
        b = len(self.seqs)
        return self._tables[b:].view(b, -1)


@dataclass(frozen=True)
class ChunkRows:
    """Ledger tokens ``[start, start + T)`` of one sequence. ``want_logits``: the chunk samples, so
    the forward must return the logits of its last token. ``all_logits`` (causal scoring, see
    :meth:`~ninfer.program.base.SequenceProgram.score_chunk`): the forward returns the logits of every
    chunk token, in order, instead (it implies the last token's)."""

    seq: SeqId
    tokens: torch.Tensor        # int64 [T]
    positions: torch.Tensor     # int64 [T]
    slot: int
    start: int
    kv_len: int                 # start + T
    page_table: torch.Tensor    # int32 [1, maxp]
    slot_mapping: torch.Tensor  # int64 [T]
    want_logits: bool
    all_logits: bool = False


@dataclass(frozen=True)
class ForwardBatch:
    """One unit's model call: decode rows, at most one chunk, at least one of the two."""

    decode: DecodeRows | None
    chunk: ChunkRows | None

    @property
    def num_logit_rows(self) -> int:
        b = len(self.decode.seqs) if self.decode is not None else 0
        if self.chunk is not None and self.chunk.all_logits:
            return b + int(self.chunk.tokens.shape[0])
        return b + (1 if self.chunk is not None and self.chunk.want_logits else 0)


@dataclass(frozen=True)
class PackedBatch:
    """One model call's N = B + T tokens as one sequence: the B decode rows (one token each) first, then
    the chunk's T tokens (one sequence), so token ``i < B`` is decode row ``i`` and ``i >= B`` the chunk.

    Every tensor is on the Program's device. The ``decode_*`` fields are None when B == 0 and the
    ``chunk_*`` fields when T == 0. A decode-only batch (T == 0, ``logit_rows`` None) is built from a
    decode graph's static inputs too: the model call must then be graph-capturable (no host tensors,
    no synchronisation)."""

    num_decode: int                          # B
    num_chunk: int                           # T
    tokens: torch.Tensor                     # int64 [N]
    positions: torch.Tensor                  # int64 [N]: each token's position (its computed index)
    slot_mapping: torch.Tensor               # int64 [N]: the flat KV slot each token's K/V is written to
    decode_slots: torch.Tensor | None        # int64 [B]: StateImage slots the decode rows read
    decode_out_slots: torch.Tensor | None    # int64 [B]: slots their new state is written to (== decode_slots
                                             # except in a lookahead step, which writes spare slots)
    decode_kv_lens: torch.Tensor | None      # int32 [B]: each row's KV length (position + 1)
    decode_page_tables: torch.Tensor | None  # int32 [B, W]: each row's pages (entries past a row's own unread)
    chunk_slot: int | None                   # the chunk sequence's StateImage slot
    chunk_cu_q: torch.Tensor | None          # int32 [2] = [0, T]
    chunk_kv_lens: torch.Tensor | None       # int32 [1] = [start + T]
    chunk_page_table: torch.Tensor | None    # int32 [1, P]: the chunk sequence's pages
    logit_rows: torch.Tensor | None          # int64 [R]: the tokens whose logits are returned, in order
                                             # (None: every token)

    @classmethod
    def decode_only(cls, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    out_slots: torch.Tensor, kv_lens: torch.Tensor, page_tables: torch.Tensor,
                    slot_mapping: torch.Tensor) -> PackedBatch:
        """B decode rows, every row's logits returned (a decode graph's inputs, in its order)."""
        return cls(num_decode=int(tokens.shape[0]), num_chunk=0, tokens=tokens, positions=positions,
                   slot_mapping=slot_mapping, decode_slots=slots, decode_out_slots=out_slots, decode_kv_lens=kv_lens,
                   decode_page_tables=page_tables, chunk_slot=None, chunk_cu_q=None, chunk_kv_lens=None,
                   chunk_page_table=None, logit_rows=None)


def pack_batch(batch: ForwardBatch, device: torch.device) -> PackedBatch:
    """``batch`` laid out as one token sequence (see :class:`PackedBatch`). A decode-only batch returns
    every row's logits; otherwise ``logit_rows`` picks the decode rows, then the chunk's last token (every
    chunk token with ``all_logits``, causal scoring: each predicts the next one)."""
    d, c = batch.decode, batch.chunk
    if c is None:
        return PackedBatch.decode_only(d.tokens, d.positions, d.slots, d.out_slots, d.kv_lens, d.page_tables,
                                       d.slot_mapping)
    b = len(d.seqs) if d is not None else 0
    t = int(c.tokens.shape[0])
    parts = [x for x in (d, c) if x is not None]  # decode rows first, then the chunk
    if c.all_logits:
        rows = list(range(b + t))
    else:
        rows = list(range(b)) + ([b + t - 1] if c.want_logits else [])
    return PackedBatch(
        num_decode=b, num_chunk=t, tokens=torch.cat([x.tokens for x in parts]),
        positions=torch.cat([x.positions for x in parts]), slot_mapping=torch.cat([x.slot_mapping for x in parts]),
        decode_slots=d.slots if d else None, decode_out_slots=d.out_slots if d else None,
        decode_kv_lens=d.kv_lens if d else None, decode_page_tables=d.page_tables if d else None,
        chunk_slot=c.slot, chunk_cu_q=torch.tensor([0, t], dtype=torch.int32, device=device),
        chunk_kv_lens=torch.tensor([c.kv_len], dtype=torch.int32, device=device), chunk_page_table=c.page_table,
        logit_rows=torch.tensor(rows, dtype=torch.int64, device=device))
