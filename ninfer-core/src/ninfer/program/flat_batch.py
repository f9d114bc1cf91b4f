"""A step as flat varlen rows, padded to fixed sizes: the layout a prefill or mixed-step CUDA graph replays
(docs/dev/prefill-graphs.md).

:func:`pack_flat` lays a :class:`~ninfer.program.batch.ForwardBatch` out as :func:`~ninfer.program.batch.pack_batch`
does (the same tokens in the same order, the same logit rows), except that every decode row is a one-token *chunk*:
the call has no decode rows, and its ``R`` rows (decode rows, then the chunks) are described only by device tensors
(offsets, KV lengths, page tables, state slots). So an architecture whose chunk path reads nothing on the host runs
any mix of rows through one code path, and a graph of it is keyed by its padded sizes alone.

Padding, to the sizes of a :class:`FlatSizes` (``tokens`` tokens, ``rows`` rows of ``pages`` pages, ``logit_rows``
logit rows):

- tokens past the real ones belong to no row (the offsets end at the real count): token 0, position 0, and KV slot
  ``pad_kv_slot`` (-1 on CUDA, which the device KV writes drop; a slot of a page no sequence uses where the writes
  check their range);
- padded rows are empty: no token, KV length 0, page table zeros, state slot ``pad_state_slot``, a slot no sequence
  holds (every padded row shares it; the varlen ops leave an empty row's state as it was);
- padded logit rows read token 0 and are not sampled.

``PackedBatch.padded`` marks such a call; the model then zeroes the outputs of the tokens in no row (those past the
last offset, a device value) where they enter the residual stream, so they stay finite. Invariant: the first
``num_logit_rows`` logits equal those of the ``pack_batch`` layout up to the arithmetic of the chunk path (a decode
row runs the architecture's chunk path, not its decode kernels).

:func:`flat_tensors` gives the host description, :func:`flat_views` the PackedBatch over device buffers holding it
(a graph's static inputs), :func:`pack_flat` both at once for an eager call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.contracts.program import ProgramError
from ninfer.program.batch import ForwardBatch, PackedBatch, to_device


def flat_needs(batch: ForwardBatch) -> tuple[int, int, int, int] | None:
    """``(tokens, rows, pages, logit rows)`` of ``batch`` laid out flat, before padding; None when the flat layout
    cannot carry it (a verify or scoring chunk, decode tokens drawn on the device, a decode row writing another
    slot)."""
    d, chunks = batch.decode, batch.chunks
    if any(c.verify or c.all_logits for c in chunks):
        return None
    if d is not None and (d.token_ids is None or d.state_out_slots != d.state_slots):
        return None
    b = len(d.seqs) if d is not None else 0
    pages = max([1] + [len(p) for p in (d.pages if d is not None else ())] + [len(c.pages) for c in chunks])
    return b + sum(c.num_tokens for c in chunks), b + len(chunks), pages, batch.num_logit_rows


@dataclass(frozen=True)
class FlatSizes:
    """The padded sizes of a flat call: ``tokens`` tokens, ``rows`` rows of at most ``pages`` pages, ``logit_rows``
    logit rows; ``pad_kv_slot`` / ``pad_state_slot`` where padded tokens and rows point (module docstring)."""

    tokens: int
    rows: int
    pages: int
    logit_rows: int
    pad_kv_slot: int
    pad_state_slot: int

    def holds(self, needs: tuple[int, int, int, int] | None) -> bool:
        """Whether a step of :func:`flat_needs` ``needs`` can be laid out flat in these sizes."""
        return needs is not None and all(
            n <= cap for n, cap in zip(needs, (self.tokens, self.rows, self.pages, self.logit_rows), strict=True))


def flat_tensors(batch: ForwardBatch, sizes: FlatSizes) -> tuple[torch.Tensor, torch.Tensor]:
    """The host description of ``batch`` laid out flat in ``sizes``, as two CPU tensors: int64 (tokens, positions,
    KV slots [tokens each], logit rows [logit_rows], state slots [rows]) and int32 (offsets [rows + 1], KV lengths
    [rows], page tables [rows x pages]). Raises ProgramError when the batch does not fit (:meth:`FlatSizes.holds`).

    The page tables are most of it (every row padded to the pages of max_context) and mostly zeros: they are
    filled row by row into a zeroed tensor, so building them costs the pages in use, not the padded width."""
    needs = flat_needs(batch)
    if not sizes.holds(needs):
        raise ProgramError(f"a step of (tokens, rows, pages, logit rows) {needs} does not fit the flat sizes "
                           f"{(sizes.tokens, sizes.rows, sizes.pages, sizes.logit_rows)} (None: it has a verify or "
                           f"scoring chunk or decode tokens drawn on the device)")
    d, chunks = batch.decode, batch.chunks
    b = len(d.seqs) if d is not None else 0
    # Per row: (q_len, kv_len, pages, state slot); then the token layout of pack_batch.
    meta = [(1, a + 1, p, s) for a, p, s in zip(d.at, d.pages, d.state_slots, strict=True)] if d is not None else []
    meta += [(c.num_tokens, c.kv_len, c.pages, c.slot) for c in chunks]
    ids = list(d.token_ids) if d is not None else []
    positions = list(d.at) if d is not None else []
    kv_slots = list(d.kv_slots) if d is not None else []
    logits = list(range(b))
    at = b
    for c in chunks:
        ids.extend(c.token_ids)
        positions.extend(range(c.start, c.kv_len))
        kv_slots.extend(c.kv_slots)
        if c.want_logits:
            logits.append(at + c.num_tokens - 1)
        at += c.num_tokens
    pad, empty = sizes.tokens - len(ids), sizes.rows - len(meta)
    wide = torch.tensor(ids + [0] * pad + positions + [0] * pad + kv_slots + [sizes.pad_kv_slot] * pad
                        + logits + [0] * (sizes.logit_rows - len(logits)) + [m[3] for m in meta]
                        + [sizes.pad_state_slot] * empty, dtype=torch.int64)
    cu = [0]
    for q_len, *_ in meta:
        cu.append(cu[-1] + q_len)
    head = cu + [cu[-1]] * empty + [m[1] for m in meta] + [0] * empty
    narrow = torch.zeros(len(head) + sizes.rows * sizes.pages, dtype=torch.int32)
    narrow[:len(head)] = torch.tensor(head, dtype=torch.int32)
    tables = narrow[len(head):].view(sizes.rows, sizes.pages)   # past a row's pages: never read (its kv length)
    for r, (_, _, row_pages, _) in enumerate(meta):
        if len(row_pages):
            tables[r, :len(row_pages)] = torch.as_tensor(row_pages, dtype=torch.int32)
    return wide, narrow


def flat_views(big: torch.Tensor, small: torch.Tensor, sizes: FlatSizes) -> PackedBatch:
    """The padded flat PackedBatch over device buffers holding :func:`flat_tensors`' two tensors (a graph's static
    inputs, or a step's copies). Its host fields describe the padded shape only."""
    n, r, lr = sizes.tokens, sizes.rows, sizes.logit_rows
    return PackedBatch(
        num_decode=0, num_chunk=n, tokens=big[:n], positions=big[n:2 * n], slot_mapping=big[2 * n:3 * n],
        decode_slots=None, decode_out_slots=None, decode_kv_lens=None, decode_page_tables=None,
        chunk_slots=(sizes.pad_state_slot,) * r, chunk_lens=(0,) * r,
        chunk_cu_q=small[:r + 1], chunk_kv_lens=small[r + 1:2 * r + 1],
        chunk_page_tables=small[2 * r + 1:].view(r, sizes.pages), logit_rows=big[3 * n:3 * n + lr],
        chunk_state_slots=big[3 * n + lr:3 * n + lr + r], padded=True)


def pack_flat(batch: ForwardBatch, device: torch.device, sizes: FlatSizes) -> PackedBatch:
    """``batch`` as flat rows padded to ``sizes`` on ``device`` (module docstring; ProgramError when it does not
    fit)."""
    wide, narrow = flat_tensors(batch, sizes)
    return flat_views(to_device(wide, torch.int64, device), to_device(narrow, torch.int32, device), sizes)
