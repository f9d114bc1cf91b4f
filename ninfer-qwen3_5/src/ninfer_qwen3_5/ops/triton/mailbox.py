"""Triton kernels that move a host-expert call through its page-locked mailbox
(:mod:`ninfer_qwen3_5.layers.host_mailbox`), so that a captured decode graph needs no copy node around the host's
work.

- :func:`post`: the call's rows of ``x`` (bf16 kept as it is, fp32 as it is), the router's ``weights`` (fp32)
  and ``ids`` (int64) and each pair's skip flag (the choices the device computes) stored straight into the
  mailbox's host memory (unified addressing), and the token count into its ``count`` word. One program a token.
  The flags are posted with the call, not set once: graphs of different batch sizes may leave different choices
  to the device, and the host function reads them when it runs.
- :func:`fetch`: ``((sum + part) + term).to(dtype)`` for the host's fp32 sum read from host memory in place, the
  optional device ``part`` (the pairs the device read over the bus, in the activation dtype, widened) and the
  optional fp32 ``term`` on the device (the shared expert's): the same operations in the same order, fp32 adds
  then one rounding (to nearest even, as torch's ``.to``), that the eager host step ends with.

Invariants:
- Host memory is written through to it (``.wt``) and read past the device's caches (``.cv``): the host writes the
  sum between two replays of one graph, and a line of the previous replay's sum cached on the device must not be
  read again.
- Plain launches (no PDL): :func:`post` starts after the kernels that made ``x``, ``weights`` and ``ids`` have
  finished, and :func:`fetch` after the host function; neither synchronizes with the host, so both are capturable.
- Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.triton._common import INTERPRET, TL_DTYPE, cast, launch_ok, next_pow2

_BLOCK_H = 1024


@triton.jit(do_not_specialize=["T"])   # one variant for every token count (a count of 1 would be a constant)
def _post_kernel(x_ptr, w_ptr, ids_ptr, hx_ptr, hw_ptr, hids_ptr, hskip_ptr, count_ptr, T, H, K, D, stride_x,
                 stride_w, stride_ids, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = cols < H
        v = tl.load(x_ptr + row * stride_x + cols, mask=m)
        tl.store(hx_ptr + row * H + cols, v.to(hx_ptr.dtype.element_ty), mask=m, cache_modifier=".wt")
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    w = tl.load(w_ptr + row * stride_w + kk, mask=km, other=0.0).to(tl.float32)
    e = tl.load(ids_ptr + row * stride_ids + kk, mask=km, other=0).to(tl.int64)
    tl.store(hw_ptr + row * K + kk, w, mask=km, cache_modifier=".wt")
    tl.store(hids_ptr + row * K + kk, e, mask=km, cache_modifier=".wt")
    tl.store(hskip_ptr + row * K + kk, (kk >= K - D).to(tl.uint8), mask=km, cache_modifier=".wt")
    if t == 0:
        tl.store(count_ptr, T.to(tl.int64), cache_modifier=".wt")


@triton.jit
def _fetch_kernel(sum_ptr, part_ptr, term_ptr, out_ptr, H, stride_part, stride_term, stride_out,
                  HAS_PART: tl.constexpr, HAS_TERM: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr,
                  INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    v = tl.load(sum_ptr + t * H + cols, mask=m, other=0.0, cache_modifier=".cv")
    if HAS_PART:
        v = v + tl.load(part_ptr + t * stride_part + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_TERM:
        v = v + tl.load(term_ptr + t * stride_term + cols, mask=m, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, cast(v, OUT_DTYPE, INTERP), mask=m)


def post(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, hx: torch.Tensor, hw: torch.Tensor,
         hids: torch.Tensor, hskip: torch.Tensor, count: torch.Tensor, device_choices: int = 0) -> None:
    """Store ``x [T, H]``, ``weights [T, k]`` and ``ids [T, k]`` into the mailbox's first T rows of ``hx`` (x's
    dtype), ``hw`` (fp32) and ``hids`` (int64), each row's skip flags into ``hskip`` (uint8: 1 for its last
    ``device_choices`` choices, which the device computes, else 0) and T (at least 1) into ``count[0]`` (int64):
    module docstring."""
    launch_ok(x)
    tokens, hidden = x.shape
    k = ids.shape[1]
    if tokens > hx.shape[0] or hx.dtype != x.dtype or hx.shape[1] != hidden or hids.shape[1] != k:
        raise ValueError(f"mailbox post: {tokens} rows of {hidden} ({x.dtype}), k={k}, do not fit a mailbox of "
                         f"{hx.shape[0]} rows of {hx.shape[1]} ({hx.dtype}), k={hids.shape[1]}")
    if tokens == 0:
        raise ValueError("mailbox post: a call with no tokens has nothing for the host")
    if not 0 <= device_choices <= k:
        raise ValueError(f"mailbox post: {device_choices} of {k} choices left to the device")
    if x.stride(1) != 1:
        x = x.contiguous()
    weights, ids = weights.contiguous(), ids.contiguous()
    _post_kernel[(tokens,)](x, weights, ids, hx, hw, hids, hskip, count, tokens, hidden, k, device_choices,
                            x.stride(0), weights.stride(0), ids.stride(0), BLOCK_H=min(_BLOCK_H, next_pow2(hidden)),
                            BLOCK_K=next_pow2(k), num_warps=4)


def fetch(host_sum: torch.Tensor, tokens: int, term: torch.Tensor | None, dtype: torch.dtype,
          device: torch.device, part: torch.Tensor | None = None) -> torch.Tensor:
    """``((host_sum[:tokens] + part) + term).to(dtype)`` on ``device`` (``part`` ``[tokens, H]`` in any float dtype,
    widened, or None; ``term`` fp32 ``[tokens, H]`` or None): module docstring."""
    hidden = host_sum.shape[1]
    out = torch.empty((tokens, hidden), dtype=dtype, device=device)
    launch_ok(out)
    if tokens == 0:
        return out
    term = term if term is None or term.stride(1) == 1 else term.contiguous()
    part = part if part is None or part.stride(1) == 1 else part.contiguous()
    block = min(_BLOCK_H, next_pow2(hidden))
    _fetch_kernel[(tokens, triton.cdiv(hidden, block))](
        host_sum, out if part is None else part, out if term is None else term, out, hidden,
        0 if part is None else part.stride(0), 0 if term is None else term.stride(0), out.stride(0),
        HAS_PART=part is not None, HAS_TERM=term is not None, OUT_DTYPE=TL_DTYPE[dtype], BLOCK_H=block,
        INTERP=INTERPRET, num_warps=4)
    return out
