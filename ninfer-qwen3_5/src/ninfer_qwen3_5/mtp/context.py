"""Where the MTP layer's K/V live, and the :class:`~ninfer_qwen3_5.layers.context.StepContext` of one MTP call.

KV storage: the MTP layer keeps K/V for every position of every sequence in one more attention-layer pool of
the Program's :class:`~ninfer.storage.kv_pool.PagedKVCache`, keyed :func:`mtp_kv_layer` (a layer id past the
text layers). All pools share one page table per sequence, so the MTP K/V of position ``t`` sits in the
same flat slot as the target's K/V of position ``t``: no pages of its own, no table of its own.

Alignment (the MTP layer's K/V of position ``t`` is computed from ``(h_t, x_{t+1})`` and rotated at position
``t``): after the target has computed positions ``[0, n]`` and sampled ``x_{n+1}``, the MTP pool can be
complete for positions ``[0, n]``; its position ``t`` needs the token after it, so it is always at least one
position behind the target's ledger until that token is sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import to_device
from ninfer.storage.kv_pool import PagedKVCache

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.context import StepContext


def mtp_kv_layer(cfg: Qwen35Config, j: int = 0) -> int:
    """The KV pool id of MTP layer ``j``: ``num_layers + j`` (never a text layer's index)."""
    return cfg.num_layers + j


def mtp_step_context(kv: PagedKVCache, *, decode: Sequence[tuple[object, int]] = (),
                     chunks: Sequence[tuple[object, int, int]] = (), device: torch.device) -> StepContext:
    """The context of one MTP call over ``kv``: ``decode`` rows ``(seq, position)`` (one token each, KV length
    ``position + 1``), then ``chunks`` ``(seq, start, length)`` (positions ``[start, start + length)``, causal
    over the sequence's cached MTP prefix, KV length ``start + length``), packed in that order as the target's
    calls are. Every position written must be covered by the sequence's pages (``kv.ensure``); a sequence is
    in at most one row or chunk. The StateImage fields are empty: the MTP layer reads no recurrent state."""
    seqs = [s for s, _ in decode] + [s for s, _, _ in chunks]
    if len(set(seqs)) != len(seqs):
        raise ProgramError(f"an MTP call has a sequence in more than one row or chunk: {seqs}")
    if any(n < 1 for _, _, n in chunks):
        raise ProgramError("an MTP chunk needs at least one position")
    positions = [p for _, p in decode] + [t for _, s, n in chunks for t in range(s, s + n)]
    slots = [kv.slot_mapping(s, p, p + 1)[0] for s, p in decode]
    for s, start, n in chunks:
        slots.extend(kv.slot_mapping(s, start, start + n))
    b, t = len(decode), sum(n for _, _, n in chunks)
    lens = tuple(n for _, _, n in chunks)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)

    def ints(data, dtype):   # pinned and non-blocking: a pageable copy would wait for the whole stream
        return to_device(data, dtype, device)

    return StepContext(
        num_decode=b, num_chunk=t, positions=ints(positions, torch.int64), cos=None, sin=None,
        slot_mapping=ints(slots, torch.int64), decode_slots=None, decode_out_slots=None,
        decode_kv_lens=ints([p + 1 for _, p in decode], torch.int32) if b else None,
        decode_page_tables=(kv.page_table_tensor([s for s, _ in decode], [p + 1 for _, p in decode],
                                                 non_blocking=True).to(device) if b else None),
        chunk_slots=(), chunk_lens=lens,
        chunk_cu_q=ints(cu, torch.int32) if chunks else None,
        chunk_kv_lens=ints([s + n for _, s, n in chunks], torch.int32) if chunks else None,
        chunk_page_tables=(kv.page_table_tensor([s for s, _, _ in chunks], [s + n for _, s, n in chunks],
                                                non_blocking=True).to(device) if chunks else None),
        kv=kv, states=None)
