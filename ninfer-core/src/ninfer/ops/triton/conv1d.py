"""Triton ``causal_conv1d_update``: one decode token per row of the depthwise causal conv + SiLU, the state
updated in place in ``conv_states[slots[b]]``.

Invariants (those of :mod:`ninfer.ops.reference.conv1d`):
- window = [state[slot] (cast to x.dtype) | x] along the K taps; ``y = silu(sum_j w[c, j] * window[c, j])``
  in fp32, one rounding to x.dtype.
- The new state is window[:, 1:] cast to the state's dtype (an exact copy when the dtypes agree); only the
  rows' own slots are read or written (slots must be distinct, as the contract says).
- Program (row, block of channels) holds the whole [BLOCK_C, K] window in registers: every load of the old
  state precedes, by data dependence, the store of the new one, so the in-place update is race-free.
- ``causal_conv1d_prefill`` stays the torch reference (one sequence per call, K=4 vectorised taps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, s_ptr, slots_ptr, y_ptr, C,
                        stride_xb, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
                        stride_yb, K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                        INTERP: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    j = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_base = s_ptr + slot * stride_ss + c[:, None] * stride_sc
    old = tl.load(s_base + j[None, :] * stride_sk, mask=c_mask[:, None] & (j[None, :] < K - 1), other=0.0)
    x = tl.load(x_ptr + b * stride_xb + c * stride_xc, mask=c_mask, other=0.0)
    # window[c, j] in x's dtype: the old state for j < K-1, the new input at j = K-1.
    window = tl.where(j[None, :] == K - 1, x[:, None], cast(old, x_ptr.dtype.element_ty, INTERP))
    w = tl.load(w_ptr + c[:, None] * stride_wc + j[None, :] * stride_wk,
                mask=c_mask[:, None] & (j[None, :] < K), other=0.0).to(tl.float32)
    acc = tl.sum(window.to(tl.float32) * w, 1)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + b * stride_yb + c, cast(y, y_ptr.dtype.element_ty, INTERP), mask=c_mask)
    # Shift by one tap: window[:, j] (j >= 1) becomes state[:, j - 1].
    tl.store(s_base + (j[None, :] - 1) * stride_sk, cast(window, s_ptr.dtype.element_ty, INTERP),
             mask=c_mask[:, None] & (j[None, :] >= 1) & (j[None, :] < K))


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """One decode token per row: ``x[B, C]`` against ``conv_states[slots[b]]`` ([S, C, K-1], in place)."""
    launch_ok(x)
    bsz, channels = x.shape
    k = weight.shape[-1]
    y = torch.empty((bsz, channels), dtype=x.dtype, device=x.device)
    if bsz == 0:
        return y
    slots = slots.to(device=x.device, dtype=torch.int64)
    block_c = min(256, next_pow2(channels))
    _conv_update_kernel[(bsz, triton.cdiv(channels, block_c))](
        x, weight, conv_states, slots, y, channels, *x.stride(), *weight.stride(), *conv_states.stride(),
        y.stride(0), K=k, BLOCK_C=block_c, BLOCK_K=next_pow2(k), INTERP=INTERPRET, num_warps=4)
    return y


OPS = [OpImpl(op="causal_conv1d_update", name="triton", fn=causal_conv1d_update, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
