"""The Gated DeltaNet of Qwen4-Exp: Qwen3.5's layer (:class:`ninfer_qwen3_5.layers.gdn.GatedDeltaNet`) whose output
norm gates with a sigmoid instead of SiLU when the config says ``output_gate_type: sigmoid`` (the released model).

Everything else is Qwen3.5's: projections, gates, short conv, the delta rule and their ops. Prefill chunks end with
``gated_rms_norm_sigmoid``; decode rows and verify chunks run Qwen3.5's ``gdn_decode`` and ``gdn_verify`` with
``GDNDecodeParams.sigmoid_gate`` (their step ends with the same sigmoid-gated norm), one launch each.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from ninfer_qwen3_5.layers.gdn import GatedDeltaNet


class SigmoidGatedDeltaNet(GatedDeltaNet):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decode_params = replace(self.decode_params, sigmoid_gate=True)

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_rms_norm_sigmoid(core, z, self.w_norm, self.eps)
