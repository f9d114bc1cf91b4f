"""Triton ``causal_conv1d_update``: one decode token per row of the depthwise causal conv + SiLU, the state
updated in place in ``conv_states[slots[b]]``.

Invariants (those of :mod:`ninfer_qwen3_5.ops.reference.conv1d`):
- window = [state[slot] (cast to x.dtype) | x] along the K taps; ``y = silu(sum_j w[c, j] * window[c, j])``
  in fp32, one rounding to x.dtype.
- The new state is window[:, 1:] cast to the state's dtype (an exact copy when the dtypes agree), written to
  ``out_slots[b]`` (default ``slots[b]``); only the rows' own slots are read or written (slots must be
  distinct, and an out slot is its row's own slot or one no row reads, as the contract says).
- Program (row, block of channels) holds the whole [BLOCK_C, K] window in registers: every load of the old
  state precedes, by data dependence, the store of the new one, so the in-place update is race-free. The taps
  and the old state are loaded before the PDL wait (:func:`conv_update_prologue`; ``gdn_decode`` reuses both
  helpers).
- ``causal_conv1d_prefill``: program (block of tokens, block of channels) reads its K-1 earlier inputs from
  x or, before the chunk's start, from conv_state; the taps accumulate in fp32 in tap order (as the reference
  does) with one rounding after SiLU. The new conv_state (the last K-1 inputs of [state | x]) is written by a
  torch copy after the kernel, so no program can read a state another one already overwrote. The reference
  takes ~10 [T, C] fp32 passes; this is one read of x and one write of y.
- ``causal_conv1d_varlen``: the same kernel over several sequences, each token finding its sequence (first token,
  state slot) in the device offsets; the new states are written by a second kernel (program per sequence and
  channel block) launched after the first, for the same reason.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2, pdl, pdl_wait


@triton.jit
def conv_update_prologue(w_ptr, s_ptr, slot, c, c_mask, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
                         K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The loads a decode conv makes before its PDL wait: the taps (weights) and the row's old state (written
    only by this layer's previous step, launches ago). Returns (old [BLOCK_C, BLOCK_K] in the state's dtype,
    taps in fp32)."""
    j = tl.arange(0, BLOCK_K)
    old = tl.load(s_ptr + slot * stride_ss + c[:, None] * stride_sc + j[None, :] * stride_sk,
                  mask=c_mask[:, None] & (j[None, :] < K - 1), other=0.0)
    w = tl.load(w_ptr + c[:, None] * stride_wc + j[None, :] * stride_wk,
                mask=c_mask[:, None] & (j[None, :] < K), other=0.0).to(tl.float32)
    return old, w


@triton.jit
def conv_update_finish(x, old, w, s_ptr, out_slot, c, c_mask, stride_ss, stride_sc, stride_sk,
                       K: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """SiLU of the taps over [old state | x] (fp32, returned) and the rolled state stored to ``out_slot``.
    Every load of the old state precedes this store by data dependence, so an in-place update is race-free."""
    j = tl.arange(0, BLOCK_K)
    # window[c, j] in x's dtype: the old state for j < K-1, the new input at j = K-1.
    window = tl.where(j[None, :] == K - 1, x[:, None], cast(old, x.dtype, INTERP))
    acc = tl.sum(window.to(tl.float32) * w, 1)
    # Shift by one tap: window[:, j] (j >= 1) becomes state[:, j - 1] of the output slot.
    o_base = s_ptr + out_slot * stride_ss + c[:, None] * stride_sc
    tl.store(o_base + (j[None, :] - 1) * stride_sk, cast(window, s_ptr.dtype.element_ty, INTERP),
             mask=c_mask[:, None] & (j[None, :] >= 1) & (j[None, :] < K))
    return acc / (1.0 + tl.exp(-acc))


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "out_slots_ptr"])
def _conv_update_kernel(x_ptr, w_ptr, s_ptr, slots_ptr, out_slots_ptr, y_ptr, C,
                        stride_xb, stride_xc, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
                        stride_yb, K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                        INTERP: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    old, w = conv_update_prologue(w_ptr, s_ptr, slot, c, c_mask, stride_wc, stride_wk, stride_ss, stride_sc,
                                  stride_sk, K, BLOCK_K)
    pdl_wait(PDL)
    x = tl.load(x_ptr + b * stride_xb + c * stride_xc, mask=c_mask, other=0.0)
    out_slot = tl.load(out_slots_ptr + b).to(tl.int64)
    y = conv_update_finish(x, old, w, s_ptr, out_slot, c, c_mask, stride_ss, stride_sc, stride_sk, K, BLOCK_K,
                           INTERP)
    tl.store(y_ptr + b * stride_yb + c, cast(y, y_ptr.dtype.element_ty, INTERP), mask=c_mask)


@triton.jit
def conv_taps_silu(x_ptr, w_ptr, s_ptr, t, c, tm, cm, start, srow, stride_xt, stride_wc, stride_wk, stride_sc,
                   stride_sk, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INTERP: tl.constexpr):
    """SiLU of the K taps of tokens ``t`` (fp32 [BLOCK_T, BLOCK_C]) over u = [state | the sequence's rows of x]: tap
    j of token t reads x row t + j - (K-1) when that is at or after its sequence's first token ``start``, else
    column t - start + j of the state at element offset ``srow`` of ``s_ptr``. The taps accumulate in tap order."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        src = t + j - (K - 1)
        in_x = src >= start
        xv = tl.load(x_ptr + tl.where(in_x, src, 0)[:, None] * stride_xt + c[None, :],
                     mask=(tm & in_x)[:, None] & cm[None, :], other=0.0)
        sv = tl.load(s_ptr + srow + c[None, :] * stride_sc + tl.where(in_x, 0, t - start + j)[:, None] * stride_sk,
                     mask=(tm & (src < start))[:, None] & cm[None, :], other=0.0)
        u = tl.where(in_x[:, None], xv, cast(sv, x_ptr.dtype.element_ty, INTERP)).to(tl.float32)
        w = tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=cm, other=0.0).to(tl.float32)
        acc += u * w[None, :]
    return acc / (1.0 + tl.exp(-acc))


@triton.jit(do_not_specialize=["T"])
def _conv_prefill_kernel(x_ptr, w_ptr, s_ptr, y_ptr, T, C, stride_xt, stride_wc, stride_wk, stride_sc, stride_sk,
                         stride_yt, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         INTERP: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm = t < T
    cm = c < C
    y = conv_taps_silu(x_ptr, w_ptr, s_ptr, t, c, tm, cm, 0, 0, stride_xt, stride_wc, stride_wk, stride_sc,
                       stride_sk, K, BLOCK_T, BLOCK_C, INTERP)
    tl.store(y_ptr + t[:, None] * stride_yt + c[None, :], cast(y, y_ptr.dtype.element_ty, INTERP),
             mask=tm[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["T", "NSEQ"], do_not_specialize_on_alignment=["cu_ptr", "slot_ptr"])
def _conv_varlen_kernel(x_ptr, w_ptr, s_ptr, cu_ptr, slot_ptr, y_ptr, T, C, NSEQ, stride_xt, stride_wc, stride_wk,
                        stride_ss, stride_sc, stride_sk, stride_yt, K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr, INTERP: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm = t < T
    cm = c < C
    # Each token's sequence (the last one starting at or before it): its first token and its state slot. The
    # offsets are one vector load of BS >= NSEQ lanes (a flat step has a row per state slot: a loop over them was a
    # serial chain of loads in every program); sequence 0 and lanes past NSEQ start "never".
    i = tl.arange(0, BS)
    s_i = tl.load(cu_ptr + i, mask=(i >= 1) & (i < NSEQ), other=2147483647)
    after = t[:, None] >= s_i[None, :]
    seq = tl.sum(after.to(tl.int32), 1)     # offsets do not decrease: the last sequence started is the count
    start = tl.max(tl.where(after, s_i[None, :], 0), 1)
    slot = tl.load(slot_ptr + seq, mask=tm, other=0).to(tl.int64)
    y = conv_taps_silu(x_ptr, w_ptr, s_ptr, t, c, tm, cm, start, (slot * stride_ss)[:, None], stride_xt,
                       stride_wc, stride_wk, stride_sc, stride_sk, K, BLOCK_T, BLOCK_C, INTERP)
    tl.store(y_ptr + t[:, None] * stride_yt + c[None, :], cast(y, y_ptr.dtype.element_ty, INTERP),
             mask=tm[:, None] & cm[None, :])


@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "slot_ptr"])
def _conv_varlen_state_kernel(x_ptr, s_ptr, cu_ptr, slot_ptr, C, stride_xt, stride_ss, stride_sc, stride_sk,
                              K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    # Program (sequence, block of channels): the new state is the last K-1 rows of u = [old state | the
    # sequence's rows of x]. Launched after _conv_varlen_kernel, which read the old states.
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    start = tl.load(cu_ptr + i)
    length = tl.load(cu_ptr + i + 1) - start
    base = s_ptr + tl.load(slot_ptr + i).to(tl.int64) * stride_ss + c[:, None] * stride_sc
    m = tl.arange(0, BLOCK_K)
    mm = m < K - 1
    src = length + m                    # the index into u of the new state's column m
    from_x = src >= K - 1
    xv = tl.load(x_ptr + (start + src - (K - 1))[None, :] * stride_xt + c[:, None],
                 mask=cm[:, None] & (mm & from_x)[None, :], other=0.0)
    sv = tl.load(base + tl.where(from_x, 0, src)[None, :] * stride_sk, mask=cm[:, None] & (mm & ~from_x)[None, :],
                 other=0.0)
    new = tl.where(from_x[None, :], cast(xv, s_ptr.dtype.element_ty, INTERP), sv)
    tl.debug_barrier()   # a short sequence's new columns come from old ones another thread may hold
    tl.store(base + m[None, :] * stride_sk, new, mask=cm[:, None] & mm[None, :])


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """N sequences' chunks in one call (rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of ``x[T, C]``), each continuing
    ``conv_states[slots[i]]`` ([S, C, K-1], updated in place): two launches, offsets and slots read on the device."""
    launch_ok(x)
    t_len, channels = x.shape
    k = weight.shape[-1]
    nseq = slots.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((t_len, channels), dtype=x.dtype, device=x.device)
    if t_len == 0 or nseq == 0:
        return y
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    ids = slots.to(device=x.device, dtype=torch.int64)
    block_t, block_c = 16, min(256, next_pow2(channels))
    # 8 warps: the [16, 256] tiles of the four taps spill at 4 warps in the sm_90 build (tools/sass_report.py
    # conv_varlen), not at 8.
    _conv_varlen_kernel[(triton.cdiv(t_len, block_t), triton.cdiv(channels, block_c))](
        x, weight, conv_states, cu, ids, y, t_len, channels, nseq, x.stride(0), *weight.stride(), *conv_states.stride(),
        y.stride(0), K=k, BLOCK_T=block_t, BLOCK_C=block_c, INTERP=INTERPRET, BS=max(2, next_pow2(nseq)), num_warps=8)
    if k > 1:
        _conv_varlen_state_kernel[(nseq, triton.cdiv(channels, block_c))](
            x, conv_states, cu, ids, channels, x.stride(0), *conv_states.stride(), K=k, BLOCK_C=block_c,
            BLOCK_K=max(2, next_pow2(k - 1)), INTERP=INTERPRET, num_warps=4)
    return y


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """One sequence's chunk ``x[T, C]`` (T >= 1) continuing from ``conv_state[C, K-1]`` (updated in place)."""
    launch_ok(x)
    t_len, channels = x.shape
    k = weight.shape[-1]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((t_len, channels), dtype=x.dtype, device=x.device)
    if t_len == 0:
        return y
    block_t, block_c = 16, min(256, next_pow2(channels))
    _conv_prefill_kernel[(triton.cdiv(t_len, block_t), triton.cdiv(channels, block_c))](
        x, weight, conv_state, y, t_len, channels, x.stride(0), *weight.stride(), *conv_state.stride(), y.stride(0),
        K=k, BLOCK_T=block_t, BLOCK_C=block_c, INTERP=INTERPRET, num_warps=4)
    if k > 1:
        keep = k - 1
        if t_len >= keep:
            conv_state.copy_(x[t_len - keep:].t())
        else:  # the state keeps its last keep - T columns, then the whole (short) chunk
            conv_state.copy_(torch.cat((conv_state[:, t_len:], x.t().to(conv_state.dtype)), dim=1))
    return y


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor, out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per row: ``x[B, C]`` against ``conv_states[slots[b]]`` ([S, C, K-1]); the rolled
    state goes to ``conv_states[out_slots[b]]`` (default: ``slots``, in place)."""
    launch_ok(x)
    bsz, channels = x.shape
    k = weight.shape[-1]
    y = torch.empty((bsz, channels), dtype=x.dtype, device=x.device)
    if bsz == 0:
        return y
    slot_ids = slots.to(device=x.device, dtype=torch.int64)
    out_ids = slot_ids if out_slots is None else out_slots.to(device=x.device, dtype=torch.int64)
    # The kernel reads the slot ids before its PDL wait: after a conversion kernel it launches plainly.
    converted = slot_ids is not slots or (out_slots is not None and out_ids is not out_slots)
    slots, out_slots = slot_ids, out_ids
    block_c = min(256, next_pow2(channels))
    _conv_update_kernel[(bsz, triton.cdiv(channels, block_c))](
        x, weight, conv_states, slots, out_slots, y, channels, *x.stride(), *weight.stride(), *conv_states.stride(),
        y.stride(0), K=k, BLOCK_C=block_c, BLOCK_K=next_pow2(k), INTERP=INTERPRET, num_warps=4,
        **({"PDL": False} if converted else pdl(x)))
    return y


OPS = [OpImpl(op="causal_conv1d_update", name="triton", fn=causal_conv1d_update, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10),
       OpImpl(op="causal_conv1d_prefill", name="triton", fn=causal_conv1d_prefill, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10),
       OpImpl(op="causal_conv1d_varlen", name="triton", fn=causal_conv1d_varlen, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
