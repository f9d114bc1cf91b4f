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

Invariant: steps 2-3 are the reference ``moe_experts`` arithmetic split at its fp32 sum (``routed_experts_fp32``
then ``shared_expert_fp32``), so on the CPU a host-expert layer is bitwise the reference op's result, and on a GPU
it differs from the device kernels only by their summation order.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from ninfer.ops.contracts import SharedExpert
from ninfer.ops.reference.moe import routed_experts_fp32, shared_expert_fp32
from ninfer.ops.reference.quantized import DecodedBank
from ninfer.quant import PackedWeight

_HOST = torch.device("cpu")


class HostExperts:
    """One MoE layer's routed banks in host memory: ``gate_up[E, 2I, H]`` and ``down[E, H, I]`` (tensors or
    :class:`~ninfer.quant.PackedWeight`), both on the CPU."""

    def __init__(self, gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight) -> None:
        for name, bank in (("gate_up", gate_up), ("down", down)):
            if bank.device.type != "cpu":
                raise ValueError(f"host experts need their {name} bank in host memory, got one on {bank.device}")
        # A quantized bank decodes only the experts a step routes to, to fp32.
        self.gate_up, self.down = (DecodedBank(b) if isinstance(b, PackedWeight) else b for b in (gate_up, down))

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 shared: SharedExpert | None) -> torch.Tensor:
        """``moe_experts(x, weights, ids, gate_up, down, shared=shared)`` with the routed part on the host;
        ``[T, H]`` in x.dtype on x's device."""
        routed = routed_experts_fp32(x.to(_HOST), weights.to(_HOST), ids.to(_HOST), self.gate_up, self.down)
        out = routed.to(x.device)
        if shared is not None:
            if isinstance(shared.down, PackedWeight):
                shared = replace(shared, down=shared.down.dequantize(torch.float32))
            out += shared_expert_fp32(shared, x.dtype)
        return out.to(x.dtype)
