"""Triton ``kv_cache_write``: scatter new K/V rows into the paged pools, bit-exactly.

Invariants:
- Token t lands at ``pool[slot // page, slot % page]`` for ``slot = slot_mapping[t]`` (int64 arithmetic:
  pools beyond 2^31 elements are addressed correctly); values are copied, cast only when the pool's dtype
  differs (round to nearest even, as torch's ``.to``). Every other pool element is untouched. Any strides.
- An out-of-range slot never writes and never wraps: the kernel masks it. To *raise* as the contract
  requires, the host checks the range first, which costs one device->host sync; that check is skipped while a
  CUDA graph is being captured (a sync is illegal there), where an out-of-range token is dropped instead.
- One program per token handles all KV heads of that token for both pools.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _kv_write_kernel(k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ptr, capacity,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_kpp, stride_kps, stride_kph, stride_kpd,
                     stride_vpp, stride_vps, stride_vph, stride_vpd,
                     H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < capacity)
    page = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    # An out-of-range slot stores nothing: its head bound drops to 0. (A scalar bool and-ed into a tensor
    # mask would do the same, but the triton 3.9 interpreter turns that mask into int32 and rejects it.)
    store_mask = (offs_h[:, None] < tl.where(ok, H, 0)) & (offs_d[None, :] < D)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    tl.store(kp_ptr + page * stride_kpp + off * stride_kps + offs_h[:, None] * stride_kph
             + offs_d[None, :] * stride_kpd, cast(k, kp_ptr.dtype.element_ty, INTERP), mask=store_mask)
    tl.store(vp_ptr + page * stride_vpp + off * stride_vps + offs_h[:, None] * stride_vph
             + offs_d[None, :] * stride_vpd, cast(v, vp_ptr.dtype.element_ty, INTERP), mask=store_mask)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s stream (then the range check, a sync, is skipped)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_on_host(slot_mapping: torch.Tensor, device: torch.device) -> bool:
    """Whether an op checks ``slot_mapping``'s range before launching: only a host-resident mapping, outside a
    capture. Checking a device-resident one would stall the host until the device catches up, once per call (an
    eager prefill step would synchronise in every attention layer); there the kernel's mask drops a token whose
    slot is out of range (never wraps). The engine's mappings come from its page tables, in range by construction."""
    return slot_mapping.device.type == "cpu" and not capturing(device)


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write ``k[T, Hkv, D]``/``v`` into ``k_pool``/``v_pool`` ``[P, page, Hkv, D]`` in place."""
    launch_ok(k_pool)
    t_len, hkv, d = k.shape
    page = k_pool.shape[1]
    capacity = k_pool.shape[0] * page
    if t_len == 0:
        return
    if check_on_host(slot_mapping, k_pool.device) and bool(((slot_mapping < 0) | (slot_mapping >= capacity)).any()):
        raise IndexError(f"kv_cache_write: slot_mapping outside [0, {capacity})")
    slots = slot_mapping.to(device=k_pool.device, dtype=torch.int64)
    _kv_write_kernel[(t_len,)](
        k, v, k_pool, v_pool, slots, capacity, *k.stride(), *v.stride(), *k_pool.stride(), *v_pool.stride(),
        H=hkv, D=d, PAGE=page, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), INTERP=INTERPRET,
        num_warps=4 if hkv * d >= 1024 else 1)


OPS = [OpImpl(op="kv_cache_write", name="triton", fn=kv_cache_write, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
