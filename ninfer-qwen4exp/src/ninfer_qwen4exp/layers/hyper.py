"""Hyper-connections: the residual as ``n = hc_count`` streams, read into one sub-layer input and written back
per stream (docs/architectures/qwen4exp.md).

The residual bank ``X[T, n*H]`` holds stream k in columns ``[k*H, (k+1)*H)``; it starts as the token embedding in
every stream. A module reads it as

    Xn = per-stream (1 + w) RMSNorm of X
    m  = sigmoid(W_up silu(W_down Xn / n))            [T, n*H]
    u  = mean_k(m_k * Xn_k)                           [T, H]   the sub-layer's input
    a  = 2 * sigmoid(W_inject Xn / n)                 [T, n]   per-stream injection weights

and after the sub-layer F writes ``X_k <- X_k + a_k * F(u)`` into the un-normalised bank. The final reduction reads
the bank the same way without injection; its ``u`` is what the LM head multiplies (there is no final norm).
W_down and W_inject read the same normed bank: they are one GEMM (one ``mix_in`` parent). The low-rank activation
(``hc_act``), the steps after the up projection (``hc_mix``: the sigmoid, the gated mean over streams, the injection
weights) and the write (``hc_write``) are ops, so a kernel does each in one launch. Every operation keeps the checkpoint module's roundings (each
elementwise step in the activation dtype, the mean in torch's).
"""

from __future__ import annotations

import torch
from ninfer_qwen3_5.layers.fused import project, row_groups


class HyperConnection:
    def __init__(self, streams: int, hidden: int, eps: float, w: dict[str, torch.Tensor], ops) -> None:
        self.ops, self.n, self.h, self.eps = ops, streams, hidden, eps
        self.w_norm, self.w_up = w["norm"], w["up"]
        self.inject = "inject" in w
        self.in_groups = row_groups([w["down"], w["inject"]] if self.inject else [w["down"]])

    def read(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(u[T, H], injection weights[T, n] or None for the final reduction)`` of the bank ``x[T, n*H]``."""
        ops, n = self.ops, self.n
        xn = ops.rms_norm_unit_offset_grouped(x, self.w_norm, self.h, self.eps)
        outs = project(ops, xn, self.in_groups)
        z = ops.linear(ops.hc_act(outs[0], n), self.w_up)
        return ops.hc_mix(z, xn, outs[1] if self.inject else None, n)

    def write(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The bank after injecting the sub-layer output ``y[T, H]`` with ``weights[T, n]``."""
        return self.ops.hc_write(x, y, weights)
