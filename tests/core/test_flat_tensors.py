"""The flat layout's host description (ninfer.program.flat_batch.flat_tensors), value by value: decode rows as
one-token rows, then the chunks; tokens, rows and page tables padded to the flat sizes."""

from __future__ import annotations

import torch
from ninfer.program.batch import ChunkRows, DecodeRows, ForwardBatch
from ninfer.program.flat_batch import FlatSizes, flat_tensors

CPU = torch.device("cpu")


def test_every_field_in_its_place_and_the_padding():
    d = DecodeRows(seqs=(1, 2), device=CPU, at=(5, 9), state_slots=(3, 0), state_out_slots=(3, 0), kv_slots=(45, 61),
                   pages=((4, 2), (7, 8, 1)), token_ids=(11, 12))
    c = ChunkRows(seq=3, device=CPU, slot=2, start=4, token_ids=(21, 22, 23), kv_slots=(50, 51, 52), pages=(6, 5),
                  want_logits=True)
    sizes = FlatSizes(tokens=8, rows=4, pages=5, logit_rows=4, pad_kv_slot=-1, pad_state_slot=7)
    wide, narrow = flat_tensors(ForwardBatch(decode=d, chunks=(c,)), sizes)
    assert wide.dtype == torch.int64 and narrow.dtype == torch.int32
    assert wide.tolist() == ([11, 12, 21, 22, 23, 0, 0, 0]         # tokens
                             + [5, 9, 4, 5, 6, 0, 0, 0]            # positions
                             + [45, 61, 50, 51, 52, -1, -1, -1]    # KV slots
                             + [0, 1, 4, 0]                        # logit rows: the decode rows, the chunk's last
                             + [3, 0, 2, 7])                       # state slots, the padded row's the spare one
    assert narrow.tolist() == ([0, 1, 2, 5, 5]                     # offsets, the padded row empty
                               + [6, 10, 7, 0]                     # KV lengths
                               + [4, 2, 0, 0, 0, 7, 8, 1, 0, 0, 6, 5, 0, 0, 0, 0, 0, 0, 0, 0])   # page tables
