"""Torch reference ``qk_norm_rope_cache``: a Qwen3.5 gated-attention layer's q/k norms, RoPE and KV write.

By definition (contract) the composition of core's ``rms_norm_unit_offset`` (the zero-centred q/k norms) ->
``rope`` for q and for k, then ``kv_cache_write`` of the normed, rotated k and the raw v; the reference composes
the three core reference ops, so its values are theirs bit for bit. Implementations that fuse it (one kernel per
decode step instead of five launches) must match these values up to the norm's reduction order.
"""

from __future__ import annotations

import torch
from ninfer.ops.reference.kv_cache import kv_cache_write
from ninfer.ops.reference.norm import rms_norm_unit_offset
from ninfer.ops.reference.rope import rope
from ninfer.ops.registry import OpImpl


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, k_out)``; k_out and v are stored at ``slot_mapping`` in the pools (in place)."""
    q_out = rope(rms_norm_unit_offset(q, q_norm, eps), cos, sin)
    k_out = rope(rms_norm_unit_offset(k, k_norm, eps), cos, sin)
    kv_cache_write(k_out, v, k_pool, v_pool, slot_mapping)
    return q_out, k_out


OPS = [OpImpl(op="qk_norm_rope_cache", name="torch_reference", fn=qk_norm_rope_cache, priority=0)]
