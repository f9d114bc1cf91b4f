"""Triton ``gdn_chunk_varlen``: the chunked prefill of several sequences in one call, three launches in all.

The kernels are the prep and scan kernels of :mod:`ninfer_qwen3_5.ops.triton.gdn` (its docstring describes the
pipeline) and the one-token kernel of :mod:`ninfer_qwen3_5.ops.triton.gdn_step`, with ``VARLEN`` set. Invariants:

- Sequence i is tokens ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` and is chunked from its own first token, so each of
  its chunks computes exactly what ``gdn_chunk_prefill`` computes for it alone: the results are the same bits. A
  sequence of one token is not chunked: the one-token kernel steps it, as ``gdn_chunk_prefill`` does a one-token call
  (the same bits again).
- The call's chunks are numbered sequence after sequence (none for a one-token sequence); their count is at most
  ``ceil(T / 64) + N - 1``, which sizes the grid and the scratch from shapes alone. Prep programs past the real count
  return at once; scan and one-token programs of a sequence that is not theirs return before touching its state.
- The kernels read the offsets as one vector of ``next_pow2(N)`` lanes (a compiled variant per power of two of N).
- Scan program (value head, Dv tile, sequence i) reads and writes only ``states[slots[i]]``; the slots of non-empty
  sequences are distinct. An empty sequence has no chunk and its programs touch no state, so empty sequences may
  share a slot (a padded call's spare rows). Tokens past ``cu_seqlens[N]`` belong to no chunk and their output
  rows are never written.
- Offsets and slots are read on the device: no host synchronisation, and the launch depends only on T, N and the
  head shapes.
"""

from __future__ import annotations

import torch
import triton
from ninfer.ops.registry import OpImpl

from ninfer_qwen3_5.ops.triton.gdn import CHUNK, prefill_inputs, prefill_scratch, run_chunks
from ninfer_qwen3_5.ops.triton.gdn_step import _DTYPES

# In-kernel scratch offsets are int32: Hv x the padded rows x the widest scratch row must stay below 2^31.
_MAX_SCRATCH_ELEMENTS = 1 << 31


def gdn_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor, scale: float, *,
                     block_v_scan: int | None = None) -> torch.Tensor:
    """N sequences (rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of ``[T, H, D]`` inputs), each from ``states[slots[i]]``
    ([S, Hv, Dk, Dv] fp32, updated in place)."""
    q, k, v, r, bk, bv = prefill_inputs("gdn_chunk_varlen", q, k, v, states)
    t_len, hv, dv, nseq = q.shape[0], v.shape[1], v.shape[2], slots.shape[0]
    o = torch.empty((t_len, hv, dv), dtype=q.dtype, device=q.device)
    if t_len == 0 or nseq == 0:
        return o
    nch = triton.cdiv(t_len, CHUNK) + nseq - 1
    if hv * nch * CHUNK * max(bk, bv, CHUNK) >= _MAX_SCRATCH_ELEMENTS:
        raise ValueError(f"gdn_chunk_varlen (triton): {t_len} tokens in {nseq} sequences exceed the kernels' int32 "
                         f"scratch offsets; split the call")
    run_chunks(q, k, v, g, beta, o, states, scale, prefill_scratch(hv, nch, bk, bv, q.device), chunks=nch, r=r,
               bk=bk, bv=bv, bvs=min(block_v_scan or 16, bv), cu=cu_seqlens.to(device=q.device, dtype=torch.int32),
               slots=slots.to(device=q.device, dtype=torch.int64))
    return o


OPS = [
    OpImpl(op="gdn_chunk_varlen", name="triton", fn=gdn_chunk_varlen, devices=frozenset({"cuda"}),
           dtypes=_DTYPES, priority=10),
]
