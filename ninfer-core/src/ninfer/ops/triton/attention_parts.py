"""What the prefill attention kernels share (:mod:`ninfer.ops.triton.attention`), and its KV-split candidate.

- :func:`_locate` finds a query block's row on the device, :func:`_store_out` stores a block's normalised output
  (gated where it is stored, :func:`_sigmoid_gate`, which the decode kernels use too);
- the KV-split candidate (``NINFER_ATTN_SPLIT=1``, off by default): :func:`kv_splits` says how many parts a
  launch's blocks are cut into, the prefill kernel's ``KV_SPLIT`` variant stores each part's partials where
  :func:`_part_offsets` says, and :func:`_prefill_combine_kernel` merges them in part order. The parts follow the
  launch's size, so with the switch on a row's bits depend on the call it is in (the module invariant of
  :mod:`~ninfer.ops.triton.attention` says so). The partials take at most ``SPLIT_WAVES`` x SMs x BLOCK_M x
  (BLOCK_D + 2) x 4 bytes, outside the memory plan.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ninfer.ops.triton._common import cast
from ninfer.switches import env_switch

_NEG = tl.constexpr(-1.0e30)  # a global read inside kernels must be a constexpr

# Prefill KV split (a candidate, NINFER_ATTN_SPLIT=1): a launch of fewer than SPLIT_WAVES programs per SM cuts each
# block's keys into parts run by programs of their own, at most MAX_KV_SPLITS, merged by a combine kernel. Unlike the
# decode split the parts follow the launch's size, so a row's bits depend on the call it is in.
SPLIT_ENABLED = env_switch("NINFER_ATTN_SPLIT", False)
SPLIT_WAVES = 2
MAX_KV_SPLITS = 16


@triton.jit
def _sigmoid_gate(out, g, DT: tl.constexpr, INTERP: tl.constexpr):
    """torch's ``o * sigmoid(gate)`` in dtype DT: o rounded, sigmoid(gate) (fp32) rounded, their product (rounded
    by the caller's store)."""
    o = cast(out, DT, INTERP).to(tl.float32)
    gf = g.to(tl.float32)
    return o * cast(1.0 / (1.0 + tl.exp(-gf)), DT, INTERP).to(tl.float32)


@triton.jit
def _locate(cu_q_ptr, n_rows, pid, R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query block ``pid``'s (row, its first query token, the row's query count, the block within the row); blocks
    are numbered row after row, and a ``pid`` past them gets row == n_rows."""
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < n_rows
    starts = tl.load(cu_q_ptr + offs_b, mask=b_mask, other=0)
    ends = tl.load(cu_q_ptr + offs_b + 1, mask=b_mask, other=0)
    n_blk = tl.cdiv((ends - starts) * R, BLOCK_M)
    cum = tl.cumsum(n_blk, 0)                       # inclusive
    row = tl.sum((cum <= pid).to(tl.int32), 0)      # rows whose blocks all come before pid
    sel = offs_b == row
    q_start = tl.sum(tl.where(sel, starts, 0), 0)
    q_len = tl.sum(tl.where(sel, ends - starts, 0), 0)
    blk = pid - tl.sum(tl.where(sel, cum - n_blk, 0), 0)
    return row, q_start, q_len, blk


@triton.jit
def _store_out(out, out_ptr, gate_ptr, q_start, qi, head, m_mask, offs_d, d_mask, stride_ot, stride_oh, stride_od,
               stride_gt, D: tl.constexpr, HAS_GATE: tl.constexpr, INTERP: tl.constexpr):
    """A block's normalised output, gated (``HAS_GATE``) where it is stored."""
    if HAS_GATE:
        g = tl.load(gate_ptr + (q_start + qi)[:, None] * stride_gt + head[:, None] * D + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        out = _sigmoid_gate(out, g, out_ptr.dtype.element_ty, INTERP)
    tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :] * stride_od, cast(out, out_ptr.dtype.element_ty, INTERP),
             mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _part_offsets(pid, kvh, s, n_kvh, n_split, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where part ``s`` of block ``pid``, kv head ``kvh`` keeps its partials in the fp32 buffer: (its running maxima
    then sums, ``2 * BLOCK_M`` words; its ``[BLOCK_M, BLOCK_D]`` accumulator). Parts are laid out block-major."""
    i = ((pid * n_kvh + kvh) * n_split + s).to(tl.int64)
    return i * (2 * BLOCK_M + BLOCK_M * BLOCK_D), i * (2 * BLOCK_M + BLOCK_M * BLOCK_D) + 2 * BLOCK_M


@triton.jit(do_not_specialize=["n_rows", "n_split"], do_not_specialize_on_alignment=["cu_q_ptr"])
def _prefill_combine_kernel(cu_q_ptr, part_ptr, out_ptr, gate_ptr, n_rows, n_split,
                            stride_ot, stride_oh, stride_od, stride_gt,
                            R: tl.constexpr, D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_D: tl.constexpr, DC: tl.constexpr, INTERP: tl.constexpr,
                            HAS_GATE: tl.constexpr = False):
    """Program (query block, kv head) of a KV_SPLIT launch: its parts' partials merged in part order, then
    normalised, gated and stored as the unsplit kernel stores them. A part with no key tile holds max -1e30 and
    sum 0, which weighs nothing; a block with no visible key at all outputs zeros, as unsplit."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    row, q_start, q_len, blk = _locate(cu_q_ptr, n_rows, pid, R, BLOCK_B, BLOCK_M)
    if row < n_rows:
        pairs = tl.arange(0, BLOCK_M)
        m_all = tl.full([BLOCK_M], _NEG, tl.float32)
        for s in range(n_split):
            ml, _ = _part_offsets(pid, kvh, s, tl.num_programs(1), n_split, BLOCK_M, BLOCK_D)
            m_all = tl.maximum(m_all, tl.load(part_ptr + ml + pairs))
        l_all = tl.zeros([BLOCK_M], tl.float32)
        for s in range(n_split):
            ml, _ = _part_offsets(pid, kvh, s, tl.num_programs(1), n_split, BLOCK_M, BLOCK_D)
            l_all += tl.exp2(tl.load(part_ptr + ml + pairs) - m_all) * tl.load(part_ptr + ml + BLOCK_M + pairs)
        offs_m = blk * BLOCK_M + pairs
        qi = offs_m // R
        # The accumulators DC columns at a time: a whole [BLOCK_M, BLOCK_D] fp32 tile and the part being added spill.
        for d0 in tl.static_range(0, BLOCK_D, DC):
            offs_d = d0 + tl.arange(0, DC)
            acc = tl.zeros([BLOCK_M, DC], tl.float32)
            for s in range(n_split):
                ml, part = _part_offsets(pid, kvh, s, tl.num_programs(1), n_split, BLOCK_M, BLOCK_D)
                w = tl.exp2(tl.load(part_ptr + ml + pairs) - m_all)
                acc += w[:, None] * tl.load(part_ptr + part + pairs[:, None] * BLOCK_D + offs_d[None, :])
            _store_out(acc / tl.where(l_all > 0, l_all, 1.0)[:, None], out_ptr, gate_ptr, q_start, qi,
                       kvh * R + offs_m % R, qi < q_len, offs_d, offs_d < D, stride_ot, stride_oh, stride_od,
                       stride_gt, D, HAS_GATE, INTERP)


def kv_splits(n_prog: int, hkv: int, device: torch.device) -> int:
    """Parts each block's keys are cut into under :data:`SPLIT_ENABLED`: enough for :data:`SPLIT_WAVES` programs per
    SM where the launch has fewer (a short chunk over a long context: one program per block walks every key), at most
    :data:`MAX_KV_SPLITS`; 1 (the unsplit kernel) where it is off or the launch fills the device."""
    if not SPLIT_ENABLED or device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(MAX_KV_SPLITS, (SPLIT_WAVES * sms) // max(1, n_prog * hkv)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
