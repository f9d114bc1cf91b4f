"""The Gated DeltaNet of Qwen4-Exp: Qwen3.5's layer (:class:`ninfer_qwen3_5.layers.gdn.GatedDeltaNet`) whose output
norm gates with a sigmoid instead of SiLU when the config says ``output_gate_type: sigmoid`` (the released model).

Everything else is Qwen3.5's: projections, gates, short conv, the delta rule and their ops. The decode step is the
composition the fused ``gdn_decode`` stands for (``gdn_gates`` -> ``causal_conv1d_update`` -> ``gdn_recurrent_step``),
ending with ``gated_rms_norm_sigmoid`` instead of the SiLU norm ``gdn_decode`` fuses; it reads ``slots`` and writes
both states to ``out_slots``, as ``gdn_decode`` does.
"""

from __future__ import annotations

import torch
from ninfer_qwen3_5.layers.gdn import GatedDeltaNet


class SigmoidGatedDeltaNet(GatedDeltaNet):
    fused_verify = False   # gdn_verify fuses the SiLU-gated step; this one verifies token by token via _decode

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_rms_norm_sigmoid(core, z, self.w_norm, self.eps)

    def _decode(self, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                rec: torch.Tensor, slots: torch.Tensor, out_slots: torch.Tensor | None) -> torch.Tensor:
        ops, n = self.ops, qkv.shape[0]
        g, beta = ops.gdn_gates(a, b, self.neg_a, self.dt_bias)
        y = ops.causal_conv1d_update(qkv, self.w_conv, conv_states, slots, out_slots)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        o = ops.gdn_recurrent_step(q.reshape(n, self.hk, self.dk), k.reshape(n, self.hk, self.dk),
                                   v.reshape(n, self.hv, self.dv), g, beta, rec, slots, self.scale, out_slots)
        return self._gated_norm(o, z)
