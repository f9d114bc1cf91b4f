"""Decode rows described on the host (ninfer.program.batch.DecodeRows) and the one-copy staging of a decode
graph's inputs (ninfer.program.graphs.stage_inputs / input_views), on the CPU: whatever the batch size,
page-table width or token source, the static views read back exactly the tensors the eager path builds."""

from __future__ import annotations

import random

import pytest
import torch
from ninfer.contracts.program import ProgramError
from ninfer.program import graphs as dg
from ninfer.program.batch import DecodeRows, HostTokens

CPU = torch.device("cpu")


def rows_for(b: int, widths: list[int], rnd: random.Random, device_tokens: bool = False) -> DecodeRows:
    at = tuple(rnd.randrange(16 * w - 15, 16 * w + 1) - 1 if w else 0 for w in widths)
    toks = tuple(rnd.randrange(1000) for _ in range(b))
    return DecodeRows(
        seqs=tuple(range(10, 10 + b)), device=CPU, at=at,
        state_slots=tuple(rnd.sample(range(50), b)), state_out_slots=tuple(rnd.sample(range(50, 100), b)),
        kv_slots=tuple(rnd.randrange(10_000) for _ in range(b)),
        pages=tuple(tuple(rnd.randrange(1, 500) for _ in range(w)) for w in widths),
        token_ids=None if device_tokens else toks,
        device_tokens=torch.tensor(toks, dtype=torch.int64) if device_tokens else None)


def staged(rows: DecodeRows, max_batch: int, max_pages: int, packed: torch.Tensor,
           ring_row: int = 0) -> tuple[torch.Tensor, ...]:
    b = len(rows.seqs)
    if rows.device_tokens is not None:
        packed[:b] = rows.device_tokens
    start, host, per_row = dg.stage_inputs(rows, max_batch, max_pages, ring_row=ring_row)
    packed[start: start + host.shape[0]] = host
    assert int(packed[max_batch]) == ring_row   # the greedy kernel's host ring row, right after the tokens
    views = dg.input_views(packed, b, max_batch, max_pages)
    if per_row:
        for r, pages in enumerate(rows.pages):
            views[5][r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return views


@pytest.mark.parametrize("device_tokens", [False, True])
@pytest.mark.parametrize("max_batch,max_pages", [(1, 3), (4, 9), (8, 33), (5, 1)])
def test_views_read_back_the_eager_tensors(max_batch, max_pages, device_tokens):
    rnd = random.Random(max_batch * 100 + max_pages)
    packed = torch.full((dg._Layout.size(max_batch, max_pages),), -7, dtype=torch.int64)
    # Every batch size in turn over the same buffer, as the graphs share it.
    for b in [*range(1, max_batch + 1), *range(max_batch, 0, -1)]:
        widths = [rnd.randrange(1, max_pages + 1) for _ in range(b)]
        rows = rows_for(b, widths, rnd, device_tokens)
        tokens, positions, slots, out_slots, kv_lens, tables, slot_mapping = staged(rows, max_batch, max_pages, packed,
                                                                                    ring_row=b % dg.RING_ROWS)
        assert torch.equal(tokens, rows.tokens)
        assert torch.equal(positions, rows.positions) and torch.equal(slots, rows.slots)
        assert torch.equal(out_slots, rows.out_slots) and torch.equal(slot_mapping, rows.slot_mapping)
        assert kv_lens.dtype == torch.int32 and torch.equal(kv_lens, rows.kv_lens)
        assert tables.dtype == torch.int32 and tables.shape == (b, max_pages)
        for r, w in enumerate(widths):   # a row's own pages; entries past them are never read
            assert torch.equal(tables[r, :w], rows.page_tables[r, :w])
        assert tables.data_ptr() % 16 == 0   # the table starts on a 16-byte boundary


def test_device_tokens_are_left_in_place_and_long_tables_go_row_by_row(monkeypatch):
    rnd = random.Random(5)
    monkeypatch.setattr(dg, "_SPAN_LIMIT", 40)
    packed = torch.zeros(dg._Layout.size(4, 30), dtype=torch.int64)
    rows = rows_for(3, [29, 2, 30], rnd, device_tokens=True)
    start, host, per_row = dg.stage_inputs(rows, 4, 30)
    assert start == 4 and per_row                     # from the ring row; the table (span 90 > 40) row by row
    packed[:3] = torch.tensor([5, 6, 7])
    packed[start: start + host.shape[0]] = host
    assert packed[:3].tolist() == [5, 6, 7]
    views = staged(rows, 4, 30, packed)
    for r, p in enumerate(rows.pages):
        assert views[5][r, : len(p)].tolist() == list(p)
    with pytest.raises(ValueError, match="exceeds the graphs' 30 pages"):
        dg.stage_inputs(rows_for(1, [31], rnd), 4, 30)


def test_decode_rows_check_their_description():
    rnd = random.Random(1)
    good = rows_for(2, [1, 2], rnd)
    assert good.page_tables.shape == (2, 2) and good.kv_lens.tolist() == [a + 1 for a in good.at]
    with pytest.raises(ProgramError, match="exactly one"):
        DecodeRows(seqs=(1,), device=CPU, at=(0,), state_slots=(0,), state_out_slots=(0,), kv_slots=(0,),
                   pages=((1,),))
    with pytest.raises(ProgramError, match="exactly one"):
        DecodeRows(seqs=(1,), device=CPU, at=(0,), state_slots=(0,), state_out_slots=(0,), kv_slots=(0,),
                   pages=((1,),), token_ids=(3,), device_tokens=torch.tensor([3]))
    with pytest.raises(ProgramError, match="one position, slot"):
        DecodeRows(seqs=(1, 2), device=CPU, at=(0,), state_slots=(0, 1), state_out_slots=(0, 1), kv_slots=(0, 1),
                   pages=((1,), (2,)), token_ids=(3, 4))
    with pytest.raises(ProgramError, match="got 1 tokens"):
        DecodeRows(seqs=(1, 2), device=CPU, at=(0, 0), state_slots=(0, 1), state_out_slots=(0, 1), kv_slots=(0, 1),
                   pages=((1,), (2,)), token_ids=(3,))


class _Done:
    """A completed event (HostTokens only waits on it)."""

    waited = 0

    def synchronize(self) -> None:
        _Done.waited += 1


def test_host_tokens_are_kept_before_their_ring_row_is_reused():
    """HostTokens reads its replay's ring row; after keep() (what DecodeGraphs calls before replaying into the
    same row again) a rewrite of the row no longer changes what it answers."""
    ring = torch.zeros((dg.RING_ROWS, 4), dtype=torch.int64)
    ring[1, :3] = torch.tensor([7, 8, 9])
    t = HostTokens(ring[1, :3], _Done())
    t.keep()
    ring[1] = -5                                      # a later replay's tokens in the same row
    assert t.values() == [7, 8, 9] and t.values() == [7, 8, 9]
    ring[2, :2] = torch.tensor([4, 5])
    late = HostTokens(ring[2, :2], _Done())
    assert late.values() == [4, 5]                    # read before any reuse: the row itself
