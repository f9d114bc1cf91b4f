"""Torch reference depthwise causal conv1d + SiLU (the GDN short convolution), prefill and decode forms.

Invariants:
- Output ``y[t, c] = silu(sum_j w[c, j] * u[t + j, c])`` over ``u = [state^T | x]`` (K-1 + T rows), math in
  fp32, one rounding to x.dtype.
- The state holds the previous K-1 *inputs* (not outputs), oldest first along its last dim; after the call
  it holds the last K-1 rows of u, copied exactly (only a dtype cast if the state's dtype differs).
- ``causal_conv1d_update`` reads and writes only ``conv_states[slots[b]]``; other slots are untouched.
  slots must be distinct within a call (two rows cannot advance one sequence in the same step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.registry import OpImpl


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """One sequence's chunk ``x[T, C]`` (T >= 1) continuing from ``conv_state[C, K-1]`` (updated in place)."""
    t_len, _ = x.shape
    k = weight.shape[-1]
    u = torch.cat((conv_state.t().to(x.dtype), x), dim=0)  # [K-1+T, C], exact: state holds x.dtype inputs
    uf = u.float()
    wf = weight.float()
    # Loop over the K taps (K = 4), each a vectorised [T, C] multiply-add: no per-element Python work.
    acc = uf[0:t_len] * wf[:, 0]
    for j in range(1, k):
        acc = acc + uf[j:j + t_len] * wf[:, j]
    if k > 1:
        conv_state.copy_(u[-(k - 1):].t())
    return F.silu(acc).to(x.dtype)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """N sequences' chunks (rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of ``x``), each continuing
    ``conv_states[slots[i]]``: :func:`causal_conv1d_prefill` per sequence (it reads the offsets on the host)."""
    cu, ids = cu_seqlens.tolist(), slots.tolist()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for i, slot in enumerate(ids):
        y[cu[i]:cu[i + 1]] = causal_conv1d_prefill(x[cu[i]:cu[i + 1]], weight, conv_states[slot])
    return y


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor, out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per row: ``x[B, C]`` against ``conv_states[slots[b]]`` ([S, C, K-1]); the rolled
    state goes to ``conv_states[out_slots[b]]`` (default: ``slots``, in place)."""
    k = weight.shape[-1]
    slots = slots.to(device=conv_states.device, dtype=torch.long)
    out_slots = slots if out_slots is None else out_slots.to(device=conv_states.device, dtype=torch.long)
    window = torch.cat((conv_states.index_select(0, slots).to(x.dtype), x[:, :, None]), dim=-1)  # [B, C, K]
    y = F.silu((window.float() * weight.float()[None]).sum(dim=-1)).to(x.dtype)
    if k > 1:
        conv_states.index_copy_(0, out_slots, window[:, :, 1:].to(conv_states.dtype))
    return y


OPS = [
    OpImpl(op="causal_conv1d_prefill", name="torch_reference", fn=causal_conv1d_prefill, priority=0),
    OpImpl(op="causal_conv1d_update", name="torch_reference", fn=causal_conv1d_update, priority=0),
    OpImpl(op="causal_conv1d_varlen", name="torch_reference", fn=causal_conv1d_varlen, priority=0),
]
