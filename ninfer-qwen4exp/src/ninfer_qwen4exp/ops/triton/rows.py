"""Rows of a QSA call, shared by the indexer (:mod:`.indexer`) and the sparse attention (:mod:`.sparse_attention`):
a call's queries are packed rows (``cu_q`` offsets, each row's queries its last positions), and every kernel finds a
query's row on the device from ``cu_q`` (the count of rows whose queries all come before it), so nothing is read back
to the host and both ops can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def row_of(cu_q_ptr, t, n_rows, BLOCK_B: tl.constexpr):
    """The row of query ``t``: the number of rows whose queries all come before it."""
    offs = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_q_ptr + 1 + offs, mask=offs < n_rows, other=2147483647)
    return tl.sum((ends <= t).to(tl.int32), 0)


@triton.jit
def query_position(cu_q_ptr, kv_lens_ptr, t, n_rows, BLOCK_B: tl.constexpr):
    """(row, KV length, position) of query ``t``: the row's queries are its last positions."""
    b = row_of(cu_q_ptr, t, n_rows, BLOCK_B)
    start = tl.load(cu_q_ptr + b)
    end = tl.load(cu_q_ptr + b + 1)
    kv_len = tl.load(kv_lens_ptr + b)
    return b, kv_len, kv_len - (end - start) + (t - start)


def row_metadata(q: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor,
          page_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The row metadata as int32 device tensors (what the kernels read), and the row count."""
    as_i32 = dict(device=q.device, dtype=torch.int32)
    cu_q, kv_lens, page_tables = cu_q.to(**as_i32), kv_lens.to(**as_i32), page_tables.to(**as_i32)
    if cu_q.shape[0] != kv_lens.shape[0] + 1 or page_tables.shape[0] != kv_lens.shape[0]:
        raise ValueError(f"QSA: cu_q {tuple(cu_q.shape)}, kv_lens {tuple(kv_lens.shape)} and page tables "
                         f"{tuple(page_tables.shape)} do not describe the same rows")
    return cu_q, kv_lens, page_tables.contiguous(), kv_lens.shape[0]
