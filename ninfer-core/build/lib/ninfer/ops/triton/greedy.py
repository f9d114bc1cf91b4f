"""Triton ``greedy_tokens``: the row argmax that ends a temperature-0 decode step, as two small kernels.

Same contract as :func:`ninfer.ops.reference.greedy.greedy_tokens`: per row the lowest index of the maximum of
``nan_to_num(logits, nan=-inf)``, int64, written into ``out`` when given.

Why two kernels: at decode there are 1-8 rows of ~248k fp32 logits (~1 MB a row). One program per row
would stream a megabyte through a single SM; instead the partial kernel, grid ``(B, S)`` with
``S = cdiv(V, BLOCK)``, gives each program one ``BLOCK`` slice of a row (61 x 16 KB slices per row at
V = 248320), so even B = 1 spreads over the GPU, and writes the slice's (max, lowest index of it) to an
fp32/int32 ``[B, S]`` workspace. The final kernel, grid ``(B,)``, reduces a row's S partials and stores the
token.

Invariants:
- Values are mapped exactly as ``nan_to_num(nan=-inf)`` maps them: NaN -> -inf, +inf -> the logits dtype's
  largest finite value, -inf -> its negation, then compared in fp32 (exact for fp32/bf16/fp16 values and for
  those bounds), so tokens are bit-identical to the reference's, all-NaN rows (0) and ties included. Lanes
  past V are -inf after the mapping and carry indices above every real one, so they never win.
- Lowest index on ties: a slice reports the smallest index reaching its maximum; slices are disjoint, so the
  smallest reported index among the slices reaching the row maximum is the row's. The argmax is exact, so
  the result does not depend on BLOCK or on B.
- PDL protocol (:func:`~ninfer.ops.triton._common.pdl_wait`): each kernel waits once, before its first load
  (the logits are the previous kernel's output; the partials the partial kernel's), and writes nothing
  before it.
- No host sync; the workspace is ``torch.empty`` per call: the call is CUDA-graph capturable.
- ``host = (ring, row)``: the final kernel also stores each token into ``ring[row[0], b]``. On CUDA ``ring``
  is pinned host memory, which the kernel writes directly (UVA): a decode graph's tokens reach the host when
  the replay completes, with no device-to-host copy queued between replays (such a copy is GPU time on every
  step; tools/gpu_step_overhead.py measures it). ``row`` is read on the device, so it can be a graph input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.reference.greedy import check_greedy_args
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import KERNEL_DTYPES, launch_ok, next_pow2, pdl, pdl_wait

# Logits per partial program: 16 KB of fp32, 32 per thread at 4 warps; 61 programs per 248k-token row.
_BLOCK = 4096


@triton.jit
def _partial_kernel(x_ptr, val_ptr, idx_ptr, V, S, stride_x, FMAX: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (row b, slice s): max of the mapped slice and the lowest index reaching it."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    ids = s * BLOCK + tl.arange(0, BLOCK)
    mask = ids < V
    pdl_wait(PDL)
    x = tl.load(x_ptr + b.to(tl.int64) * stride_x + ids, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(x == float("inf"), FMAX, tl.where(x == -float("inf"), -FMAX, x))
    x = tl.where((x != x) | ~mask, -float("inf"), x)  # NaN (and lanes past V) count as -inf
    top = tl.max(x, 0)
    # 2147483647 (int32 max): above every real index, so it loses every lowest-index comparison.
    tl.store(val_ptr + b * S + s, top)
    tl.store(idx_ptr + b * S + s, tl.min(tl.where(x == top, ids, 2147483647), 0))


@triton.jit(do_not_specialize=["R"])   # an eager call passes its row count here (no ring): not a variant each
def _final_kernel(val_ptr, idx_ptr, out_ptr, ring_ptr, row_ptr, S, stride_out, stride_ring, R,
                  BLOCK_S: tl.constexpr, HOST: tl.constexpr, PDL: tl.constexpr):
    """Program (row b): the lowest reported index among the slices reaching the row maximum; with HOST also
    stored into the host ring's row ``row_ptr[0]`` (pinned memory, written over the bus by this store) when that
    row is one of the ring's R (a row index outside them stores nothing, never past the ring)."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < S
    pdl_wait(PDL)
    val = tl.load(val_ptr + b * S + offs, mask=mask, other=-float("inf"))
    idx = tl.load(idx_ptr + b * S + offs, mask=mask, other=2147483647)
    top = tl.max(val, 0)
    tok = tl.min(tl.where(val == top, idx, 2147483647), 0).to(tl.int64)  # all -inf rows: slice 0's first index
    tl.store(out_ptr + b.to(tl.int64) * stride_out, tok)
    if HOST:
        r = tl.load(row_ptr)
        tl.store(ring_ptr + r * stride_ring + b, tok, mask=(r >= 0) & (r < R))


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None, host: tuple | None = None) -> torch.Tensor:
    """Row argmax of ``nan_to_num(logits[B, V], nan=-inf)`` as int64 [B] (see the module docstring); ``host``:
    also into ``ring[row[0], :B]`` (the contract's host ring; on CUDA the ring must be pinned)."""
    launch_ok(logits)
    check_greedy_args(logits, out, host)
    if host is not None and logits.device.type == "cuda" and not host[0].is_pinned():
        raise ValueError("greedy_tokens (triton): the host ring must be pinned memory (the kernel stores into it)")
    if logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"greedy_tokens (triton): logits dtype {logits.dtype} is not one of fp32/bf16/fp16")
    bsz, vocab = logits.shape
    dev = logits.device
    if out is None:
        out = torch.empty(bsz, dtype=torch.int64, device=dev)
    if bsz == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n_slices = triton.cdiv(vocab, _BLOCK)
    vals = torch.empty((bsz, n_slices), dtype=torch.float32, device=dev)
    idxs = torch.empty((bsz, n_slices), dtype=torch.int32, device=dev)
    launch = pdl(logits)
    _partial_kernel[(bsz, n_slices)](logits, vals, idxs, vocab, n_slices, logits.stride(0),
                                     FMAX=torch.finfo(logits.dtype).max, BLOCK=_BLOCK, num_warps=4, **launch)
    ring, row = host if host is not None else (out, out)   # unused pointers when HOST is off
    _final_kernel[(bsz,)](vals, idxs, out, ring, row, n_slices, out.stride(0), ring.stride(0), ring.shape[0],
                          BLOCK_S=next_pow2(n_slices), HOST=host is not None, num_warps=1, **launch)
    return out


# The final kernel stores the host ring's row from the device: no sync, capturable in a CUDA graph.
greedy_tokens.host_capturable = True


OPS = [OpImpl(op="greedy_tokens", name="triton", fn=greedy_tokens, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
