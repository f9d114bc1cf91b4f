"""What one model call receives: the unit's rows addressed into the KV pool and StateImage slots.

A leaf module (it imports nothing else from :mod:`ninfer.program`), shared by the bookkeeping
(:mod:`~ninfer.program.base`), the decode graphs (:mod:`~ninfer.program.graphs`) and lookahead
decode (:mod:`~ninfer.program.lookahead`).

- :class:`ForwardBatch`: the unit as the bookkeeping prepared it: :class:`DecodeRows` (B decode rows,
  one token each) and :class:`ChunkRows` (each T_c ledger tokens of one sequence), all described on the host.
- :class:`PackedBatch`: the same unit laid out as one token sequence of N = B + T tokens (T the chunks'
  tokens together), decode rows first, then the chunks in unit order: what an architecture's model call
  reads (:func:`pack_batch` builds it).

Invariants: a decode row's token is at position ``at[b]`` and its KV length is ``at[b] + 1``; a
chunk covers ledger tokens ``[start, start + T_c)`` and its KV length is ``start + T_c``; a sequence is
in at most one row or chunk of a batch; the logits a call returns are those of
:attr:`ForwardBatch.num_logit_rows` rows: decode rows in order, then the last token of each chunk that
samples, in chunk order (every chunk token, in order, for the one chunk of an ``all_logits`` batch, and
for every speculative verify chunk: one with ``snapshot_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ninfer.contracts.program import ProgramError, SeqId


def to_device(data: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data (a sequence, or a CPU tensor) as ``dtype`` onto ``device`` without waiting for the stream: a
    pinned buffer and a non-blocking copy on CUDA (a pageable copy would synchronise with a queued lookahead
    step); a plain tensor elsewhere."""
    t = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
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
    """Ledger tokens ``[start, start + T)`` of one sequence, described on the host: ``token_ids`` the
    tokens, ``kv_slots`` the flat KV slot of each, ``pages`` the sequence's pages covering ``start + T``
    tokens. ``want_logits``: the chunk samples, so the forward must return the logits of its last token.
    ``all_logits`` (causal scoring, see :meth:`~ninfer.program.base.SequenceProgram.score_chunk`): the
    forward returns the logits of every chunk token, in order, instead (it implies the last token's).

    ``snapshot_slots`` (speculative verify: ``token_ids`` are a row's last token and its drafts): one slot
    of the architecture's speculative snapshot storage per token; the forward returns every token's
    logits, leaves the StateImage ``slot`` unchanged and stores the state after token ``j`` in
    ``snapshot_slots[j]`` (the architecture's snapshot storage defines what that state is). Such a chunk
    may share its batch with decode rows and other chunks; it never has ``all_logits``.

    The device tensors (``tokens``, ``positions``, ``slot_mapping``, ``page_table``) are made on first
    use; :func:`pack_batch` reads the host description instead and copies a whole batch's metadata at once."""

    seq: SeqId
    device: torch.device
    slot: int
    start: int
    token_ids: tuple[int, ...]
    kv_slots: tuple[int, ...]
    pages: tuple[int, ...]
    want_logits: bool
    all_logits: bool = False
    snapshot_slots: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids or len(self.kv_slots) != len(self.token_ids):
            raise ProgramError(f"chunk of sequence {self.seq} needs at least one token and one KV slot per token "
                               f"(got {len(self.token_ids)} tokens, {len(self.kv_slots)} slots)")
        if self.snapshot_slots is not None:
            if len(self.snapshot_slots) != len(self.token_ids) or len(set(self.snapshot_slots)) != len(self.token_ids):
                raise ProgramError(f"verify chunk of sequence {self.seq} needs one distinct snapshot slot per token "
                                   f"(got {len(self.snapshot_slots)} for {len(self.token_ids)} tokens)")
            if self.all_logits:
                raise ProgramError(f"verify chunk of sequence {self.seq} cannot also be a scoring chunk")

    @property
    def verify(self) -> bool:     # a speculative verify chunk: every token's logits, state to snapshots
        return self.snapshot_slots is not None

    @property
    def num_tokens(self) -> int:  # T
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:      # start + T
        return self.start + len(self.token_ids)

    @cached_property
    def tokens(self) -> torch.Tensor:        # int64 [T]
        return to_device(list(self.token_ids), torch.int64, self.device)

    @cached_property
    def positions(self) -> torch.Tensor:     # int64 [T]
        return torch.arange(self.start, self.kv_len, dtype=torch.int64, device=self.device)

    @cached_property
    def slot_mapping(self) -> torch.Tensor:  # int64 [T]
        return to_device(list(self.kv_slots), torch.int64, self.device)

    @cached_property
    def page_table(self) -> torch.Tensor:    # int32 [1, P]
        return to_device([list(self.pages) or [0]], torch.int32, self.device)


@dataclass(frozen=True)
class ForwardBatch:
    """One unit's model call: decode rows and chunks of other sequences (at least one row or chunk).
    Logit rows, in order: the decode rows, then the last token of each chunk that wants logits (every
    token of an ``all_logits`` chunk, which is then the batch's only chunk, and every token of each verify
    chunk)."""

    decode: DecodeRows | None
    chunks: tuple[ChunkRows, ...] = ()

    def __post_init__(self) -> None:
        if self.decode is None and not self.chunks:
            raise ProgramError("a forward batch needs decode rows or a chunk")
        if any(c.all_logits for c in self.chunks) and len(self.chunks) != 1:
            raise ProgramError("a chunk that returns every token's logits (causal scoring) runs alone")

    @property
    def num_logit_rows(self) -> int:
        b = len(self.decode.seqs) if self.decode is not None else 0
        return b + sum(c.num_tokens if c.all_logits or c.verify else int(c.want_logits) for c in self.chunks)


@dataclass(frozen=True)
class PackedBatch:
    """One model call's N = B + T tokens as one sequence: the B decode rows (one token each) first, then
    the C chunks in unit order (chunk ``c`` is ``chunk_lens[c]`` consecutive tokens of one sequence; T is
    their sum), so token ``i < B`` is decode row ``i`` and chunk ``c`` starts at ``B + chunk_cu_q[c]``.

    Every tensor is on the Program's device; ``chunk_slots`` and ``chunk_lens`` are host tuples, so a model
    can slice per chunk without a device synchronisation. The ``decode_*`` fields are None when B == 0
    and the tensor ``chunk_*`` fields when C == 0. A decode-only batch (C == 0, ``logit_rows`` None) is
    built from a decode graph's static inputs too: the model call must then be graph-capturable (no host
    tensors, no synchronisation).

    ``chunk_snapshots`` (host): empty when no chunk is a speculative verify chunk; otherwise one entry per
    chunk, None for an ordinary chunk and, for a verify chunk, its ``ChunkRows.snapshot_slots`` (one per
    token; its logit rows are every token of it, and its state slot ``chunk_slots[c]`` is only read)."""

    num_decode: int                          # B
    num_chunk: int                           # T: the chunks' tokens together
    tokens: torch.Tensor                     # int64 [N]
    positions: torch.Tensor                  # int64 [N]: each token's position (its computed index)
    slot_mapping: torch.Tensor               # int64 [N]: the flat KV slot each token's K/V is written to
    decode_slots: torch.Tensor | None        # int64 [B]: StateImage slots the decode rows read
    decode_out_slots: torch.Tensor | None    # int64 [B]: slots their new state is written to (== decode_slots
                                             # except in a lookahead step, which writes spare slots)
    decode_kv_lens: torch.Tensor | None      # int32 [B]: each row's KV length (position + 1)
    decode_page_tables: torch.Tensor | None  # int32 [B, W]: each row's pages (entries past a row's own unread)
    chunk_slots: tuple[int, ...]             # C host ints: each chunk sequence's StateImage slot
    chunk_lens: tuple[int, ...]              # C host ints: each chunk's token count (sum T)
    chunk_cu_q: torch.Tensor | None          # int32 [C + 1]: chunk token offsets within the T chunk tokens
    chunk_kv_lens: torch.Tensor | None       # int32 [C]: each chunk's start + length
    chunk_page_tables: torch.Tensor | None   # int32 [C, P]: each chunk sequence's pages (padded with 0, unread)
    logit_rows: torch.Tensor | None          # int64 [R]: the tokens whose logits are returned, in order
                                             # (None: every token)
    chunk_snapshots: tuple[tuple[int, ...] | None, ...] = ()   # C host entries when a chunk verifies, else ()
    chunk_state_slots: torch.Tensor | None = None   # int64 [C]: ``chunk_slots`` on the device (kernels that take
                                                    # every chunk of the call in one launch read them there)
    padded: bool = False   # a flat call padded to fixed sizes (:mod:`ninfer.program.flat_batch`): every row a chunk,
                           # tokens past ``chunk_cu_q[-1]`` in no row, padded rows empty

    @property
    def has_verify(self) -> bool:
        return any(s is not None for s in self.chunk_snapshots)

    @property
    def num_chunks(self) -> int:             # C
        return len(self.chunk_lens)

    @classmethod
    def decode_only(cls, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    out_slots: torch.Tensor, kv_lens: torch.Tensor, page_tables: torch.Tensor,
                    slot_mapping: torch.Tensor) -> PackedBatch:
        """B decode rows, every row's logits returned (a decode graph's inputs, in its order)."""
        return cls(num_decode=int(tokens.shape[0]), num_chunk=0, tokens=tokens, positions=positions,
                   slot_mapping=slot_mapping, decode_slots=slots, decode_out_slots=out_slots, decode_kv_lens=kv_lens,
                   decode_page_tables=page_tables, chunk_slots=(), chunk_lens=(), chunk_cu_q=None,
                   chunk_kv_lens=None, chunk_page_tables=None, logit_rows=None)


def pack_batch(batch: ForwardBatch, device: torch.device) -> PackedBatch:
    """``batch`` laid out as one token sequence (see :class:`PackedBatch`). A decode-only batch returns
    every row's logits; otherwise ``logit_rows`` picks the decode rows, then the last token of each chunk
    that wants logits (every chunk token with ``all_logits``, causal scoring: each predicts the next one,
    and of a verify chunk).

    The metadata of the decode rows and chunks reaches the device in two copies (pinned and non-blocking
    on CUDA): one int64 buffer (tokens, positions, KV slots, logit rows, decode state slots) and one int32
    buffer (KV lengths, page tables, chunk offsets)."""
    d, chunks = batch.decode, batch.chunks
    if not chunks:
        return PackedBatch.decode_only(d.tokens, d.positions, d.slots, d.out_slots, d.kv_lens, d.page_tables,
                                       d.slot_mapping)
    b = len(d.seqs) if d is not None else 0
    lens = tuple(c.num_tokens for c in chunks)
    n = b + sum(lens)
    rows = list(range(b))
    at = b
    for c in chunks:
        if c.all_logits or c.verify:
            rows.extend(range(at, at + c.num_tokens))
        elif c.want_logits:
            rows.append(at + c.num_tokens - 1)
        at += c.num_tokens
    if d is not None and d.token_ids is None:
        # Only a lookahead step draws its tokens on the device, and it has no chunk.
        raise ProgramError("a batch with chunks takes its decode rows' tokens from the host")
    # int64: tokens, positions, KV slots [N each], logit rows [R], decode slots and out slots [B each], chunk state
    # slots [C].
    wide: list[int] = list(d.token_ids) if d is not None else []
    for c in chunks:
        wide.extend(c.token_ids)
    wide.extend(d.at if d is not None else ())
    for c in chunks:
        wide.extend(range(c.start, c.kv_len))
    wide.extend(d.kv_slots if d is not None else ())
    for c in chunks:
        wide.extend(c.kv_slots)
    wide.extend(rows)
    if d is not None:
        wide.extend(d.state_slots)
        wide.extend(d.state_out_slots)
    wide.extend(c.slot for c in chunks)
    # int32: chunk offsets [C + 1], chunk KV lengths [C], chunk page tables [C, P], decode KV lengths [B],
    # decode page tables [B, W].
    cu = [0]
    for t in lens:
        cu.append(cu[-1] + t)
    p = max(1, max(len(c.pages) for c in chunks))
    narrow = cu + [c.kv_len for c in chunks]
    for c in chunks:
        narrow.extend(c.pages)
        narrow.extend([0] * (p - len(c.pages)))   # never read: kernels stop at each row's kv length
    w = 0
    if d is not None:
        w = max(1, max((len(x) for x in d.pages), default=1))
        narrow.extend(a + 1 for a in d.at)
        for x in d.pages:
            narrow.extend(x)
            narrow.extend([0] * (w - len(x)))
    big = to_device(wide, torch.int64, device)
    small = to_device(narrow, torch.int32, device)
    r, c_n = len(rows), len(chunks)
    tables = 2 * c_n + 1 + c_n * p   # where the decode rows' part of ``small`` starts
    decode_fields = (None, None, None, None)
    if d is not None:
        o = 3 * n + r
        decode_fields = (big[o:o + b], big[o + b:o + 2 * b], small[tables:tables + b],
                         small[tables + b:].view(b, w))
    return PackedBatch(
        num_decode=b, num_chunk=n - b, tokens=big[:n], positions=big[n:2 * n], slot_mapping=big[2 * n:3 * n],
        decode_slots=decode_fields[0], decode_out_slots=decode_fields[1], decode_kv_lens=decode_fields[2],
        decode_page_tables=decode_fields[3], chunk_slots=tuple(c.slot for c in chunks), chunk_lens=lens,
        chunk_cu_q=small[:c_n + 1], chunk_kv_lens=small[c_n + 1:2 * c_n + 1],
        chunk_page_tables=small[2 * c_n + 1:tables].view(c_n, p), logit_rows=big[3 * n:3 * n + r],
        chunk_snapshots=tuple(c.snapshot_slots for c in chunks) if any(c.verify for c in chunks) else (),
        chunk_state_slots=big[big.shape[0] - c_n:])
