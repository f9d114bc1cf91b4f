"""A step as flat varlen rows, padded to fixed sizes: the layout a prefill or mixed-step CUDA graph replays
(docs/dev/prefill-graphs.md).

:func:`pack_flat` lays a :class:`~ninfer.program.batch.ForwardBatch` out as :func:`~ninfer.program.batch.pack_batch`
does (the same tokens in the same order, the same logit rows), except that every decode row is a one-token *chunk*:
the call has no decode rows, and its ``R`` rows (decode rows, then the chunks) are described only by device tensors
(offsets, KV lengths, page tables, state slots). So an architecture whose chunk path reads nothing on the host runs
any mix of rows through one code path, and a graph of it is keyed by its padded sizes alone.

Padding, to ``tokens`` tokens, ``rows`` rows of ``pages`` pages and ``logit_rows`` logit rows:

- tokens past the real ones belong to no row (the offsets end at the real count): token 0, position 0, and KV slot
  ``pad_kv_slot`` (-1 on CUDA, which the device KV writes drop; a slot of a page no sequence uses where the writes
  check their range);
- padded rows are empty: no token, KV length 0, page table zeros, state slot ``pad_state_slot``, a slot no sequence
  holds (every padded row shares it; the varlen ops leave an empty row's state as it was);
- padded logit rows read token 0 and are not sampled.

``PackedBatch.padded`` marks such a call; the model then zeroes the outputs of the tokens in no row (those past the
last offset, a device value) where they enter the residual stream, so they stay finite. Invariant: the first ``num_logit_rows`` logits equal those
of the ``pack_batch`` layout up to the arithmetic of the chunk path (a decode row's recurrence is computed in its
chunked form).
"""

from __future__ import annotations

import torch

from ninfer.contracts.program import ProgramError
from ninfer.program.batch import ForwardBatch, PackedBatch, to_device


def flat_sizes(batch: ForwardBatch) -> tuple[int, int, int, int]:
    """``(tokens, rows, pages, logit rows)`` of ``batch`` laid out flat, before padding."""
    d, chunks = batch.decode, batch.chunks
    tokens = (len(d.seqs) if d is not None else 0) + sum(c.num_tokens for c in chunks)
    rows = (len(d.seqs) if d is not None else 0) + len(chunks)
    pages = max([1] + [len(p) for p in (d.pages if d is not None else ())] + [len(c.pages) for c in chunks])
    return tokens, rows, pages, batch.num_logit_rows


def pack_flat(batch: ForwardBatch, device: torch.device, *, tokens: int, rows: int, pages: int, logit_rows: int,
              pad_kv_slot: int, pad_state_slot: int) -> PackedBatch:
    """``batch`` as flat rows padded to the given sizes (module docstring). Raises ProgramError when it does not
    fit them, or when it has what the flat layout cannot carry (a lookahead step's device tokens, a verify or
    scoring chunk)."""
    d, chunks = batch.decode, batch.chunks
    if any(c.verify or c.all_logits for c in chunks):
        raise ProgramError("a flat step carries no verify or scoring chunk")
    if d is not None and (d.token_ids is None or d.state_out_slots != d.state_slots):
        raise ProgramError("a flat step's decode rows take their tokens from the host and update their own slots")
    need = flat_sizes(batch)
    if any(n > cap for n, cap in zip(need, (tokens, rows, pages, logit_rows), strict=True)):
        raise ProgramError(f"a step of (tokens, rows, pages, logit rows) {need} does not fit the flat sizes "
                           f"{(tokens, rows, pages, logit_rows)}")
    b = len(d.seqs) if d is not None else 0
    real_tokens = need[0]
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
    pad = tokens - real_tokens
    ids += [0] * pad
    positions += [0] * pad
    kv_slots += [pad_kv_slot] * pad
    logits += [0] * (logit_rows - len(logits))
    slots = [m[3] for m in meta] + [pad_state_slot] * (rows - len(meta))
    wide = ids + positions + kv_slots + logits + slots
    cu = [0]
    for q_len, *_ in meta:
        cu.append(cu[-1] + q_len)
    cu += [cu[-1]] * (rows - len(meta))
    narrow = cu + [m[1] for m in meta] + [0] * (rows - len(meta))
    for _, _, row_pages, _ in meta:
        narrow.extend(row_pages)
        narrow.extend([0] * (pages - len(row_pages)))   # never read: kernels stop at each row's kv length
    narrow.extend([0] * (pages * (rows - len(meta))))
    big = to_device(wide, torch.int64, device)
    small = to_device(narrow, torch.int32, device)
    n = tokens
    return PackedBatch(
        num_decode=0, num_chunk=n, tokens=big[:n], positions=big[n:2 * n], slot_mapping=big[2 * n:3 * n],
        decode_slots=None, decode_out_slots=None, decode_kv_lens=None, decode_page_tables=None,
        chunk_slots=tuple(slots), chunk_lens=tuple(m[0] for m in meta) + (0,) * (rows - len(meta)),
        chunk_cu_q=small[:rows + 1], chunk_kv_lens=small[rows + 1:2 * rows + 1],
        chunk_page_tables=small[2 * rows + 1:].view(rows, pages), logit_rows=big[3 * n:3 * n + logit_rows],
        chunk_state_slots=big[3 * n + logit_rows:], padded=True)
