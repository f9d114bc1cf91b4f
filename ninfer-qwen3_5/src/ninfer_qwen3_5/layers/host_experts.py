"""Routed experts kept in host memory and computed by the CPU (``EngineOptions.host_experts``, docs/memory.md).

A MoE layer whose expert banks are host-placed runs its router, its shared expert and everything around it on
the run device as usual; only the routed experts' weighted sum is computed on the host:

1. the layer's normed hidden rows ``x[T, H]``, the routing weights and ids go to the host (one copy each; the
   host waits for the device here, which is why decode CUDA graphs and lookahead are off with host experts);
2. the CPU computes ``sum_j w[t, j] * expert_{ids[t, j]}(x_t)`` in fp32 with torch's CPU kernels (its intra-op
   thread team), tokens grouped by expert, in whatever format the bank is stored (a quantized bank decodes only
   the experts the step routes to);
3. the fp32 sum goes back to the device, where the shared expert's fp32 term is added and the total is rounded
   once to the activation dtype.

Invariant: without a cache, steps 2-3 are the reference ``moe_experts`` arithmetic split at its fp32 sum
(``routed_experts_fp32`` then ``shared_expert_fp32``), so on the CPU a host-expert layer is bitwise the reference
op's result, and on a GPU it differs from the device kernels only by their summation order. With a device cache
(``expert_cache_slots``) the cached experts' pairs are summed on the device and rounded once to the activation
dtype before they join the fp32 sum: the same terms, one more rounding of a part of them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from ninfer.ops.contracts import SharedExpert
from ninfer.ops.reference.moe import routed_experts_fp32, shared_expert_fp32
from ninfer.ops.reference.quantized import DecodedBank
from ninfer.quant import PackedWeight

from ninfer_qwen3_5.layers.expert_cache import ExpertCache

_HOST = torch.device("cpu")


class HostExperts:
    """One MoE layer's routed banks in host memory: ``gate_up[E, 2I, H]`` and ``down[E, H, I]`` (tensors or
    :class:`~ninfer.quant.PackedWeight`), both on the CPU. With ``cache_slots`` > 0 (and ``ops``, ``device``,
    ``dtype``), an :class:`~ninfer_qwen3_5.layers.expert_cache.ExpertCache` keeps that many of them on the device:
    the pairs routed to a cached expert are computed there by ``ops.moe_experts`` (its result rounded once to the
    activation dtype, then added to the fp32 sum), the rest on the host."""

    def __init__(self, gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight, *,
                 cache_slots: int = 0, ops=None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        for name, bank in (("gate_up", gate_up), ("down", down)):
            if bank.device.type != "cpu":
                raise ValueError(f"host experts need their {name} bank in host memory, got one on {bank.device}")
        # A quantized bank decodes only the experts a step routes to, to fp32.
        self.gate_up, self.down = (DecodedBank(b) if isinstance(b, PackedWeight) else b for b in (gate_up, down))
        self.ops = ops
        self.cache = (ExpertCache(self.gate_up, self.down, cache_slots, device, dtype) if cache_slots else None)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 shared: SharedExpert | None) -> torch.Tensor:
        """``moe_experts(x, weights, ids, gate_up, down, shared=shared)`` with the routed part on the host (and
        the cached experts' pairs on the device); ``[T, H]`` in x.dtype on x's device."""
        x_h, w_h, ids_h = x.to(_HOST), weights.to(_HOST), ids.to(_HOST)
        device_part, skip = None, None
        if self.cache is not None:
            self.cache.refresh()
            skip, slot = self.cache.split(ids_h)
            self.cache.observe(ids_h)
            if bool(skip.any()):
                on_device = (w_h * skip).to(x.device)   # the host's pairs weigh zero here
                device_part = self.ops.moe_experts(x, on_device, slot.to(x.device), self.cache.gate_up,
                                                   self.cache.down)
        routed = routed_experts_fp32(x_h, w_h, ids_h, self.gate_up, self.down, skip=skip)
        out = routed.to(x.device)
        if device_part is not None:
            out += device_part.float()
        if shared is not None:
            if isinstance(shared.down, PackedWeight):
                shared = replace(shared, down=shared.down.dequantize(torch.float32))
            out += shared_expert_fp32(shared, x.dtype)
        return out.to(x.dtype)
