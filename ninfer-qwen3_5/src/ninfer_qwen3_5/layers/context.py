"""What every layer of one model call sees: the token layout, rotary tables, KV and state addressing.

Token layout of a call (N tokens): the B decode rows first (one token each), then the C chunks in unit
order (chunk ``c`` is ``chunk_lens[c]`` consecutive tokens of one sequence, T tokens together), so
``x[:B]`` are decode tokens and ``x[B:]`` the chunks.

A call with speculative verify chunks (see :mod:`ninfer_qwen3_5.speculative_state`) carries ``verify``, how
the GDN layers step them, and ``snapshots``, the storage their per-token states go to; both None otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateImageStorage

from ninfer_qwen3_5.speculative_state import VerifyPlan


@dataclass(frozen=True)
class StepContext:
    num_decode: int                         # B
    num_chunk: int                          # T: the chunks' tokens together (0 without a chunk)
    positions: torch.Tensor                 # int64 [N]: text positions (the computed index)
    cos: torch.Tensor | None                # fp32 [N, R]: the model fills these after the embedding (so the
    sin: torch.Tensor | None                # table kernel overlaps the embedding's under PDL); None before
    slot_mapping: torch.Tensor              # int64 [N]: flat KV slot of every token
    decode_slots: torch.Tensor | None       # int64 [B]: StateImage slots the decode rows read
    decode_out_slots: torch.Tensor | None   # int64 [B]: slots their new state goes to (== decode_slots but
                                            # in a lookahead step, which writes spare slots)
    decode_kv_lens: torch.Tensor | None     # int32 [B]
    decode_page_tables: torch.Tensor | None # int32 [B, maxp]
    chunk_slots: tuple[int, ...]            # C host ints: StateImage slot of each chunk's sequence
    chunk_lens: tuple[int, ...]             # C host ints: each chunk's token count
    chunk_cu_q: torch.Tensor | None         # int32 [C + 1]: chunk offsets within the T chunk tokens
    chunk_kv_lens: torch.Tensor | None      # int32 [C]: each chunk's start + length
    chunk_page_tables: torch.Tensor | None  # int32 [C, maxp]
    kv: PagedKVCache
    states: StateImageStorage
    verify: VerifyPlan | None = None        # the verify chunks' GDN steps and the ordinary chunks (host)
    snapshots: StateImageStorage | None = None   # the verify snapshots (given with ``verify``)
    chunk_state_slots: torch.Tensor | None = None   # int64 [C]: ``chunk_slots`` on the device, where the caller has
                                                    # them (then the GDN layers run every chunk in one launch per op)
    token_valid: torch.Tensor | None = None   # bool [N, 1, 1] in a padded flat call (``PackedBatch.padded``): the
                                              # tokens of some row; the mixers zero the others' outputs
