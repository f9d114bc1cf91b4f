"""Torch reference of the hyper-connections' elementwise steps around their projections: the low-rank activation
(``hc_act``), the stream mixing that makes a sub-layer's input (``hc_mix``) and the injection of its output into
every stream (``hc_write``).

Invariant: each is the checkpoint module's torch expression in the activation dtype, rounding where torch rounds
(``sigmoid`` to x.dtype, each product to x.dtype, the mean over streams summed in fp32 and rounded once), so the
model's hyper-connections on these ops are transformers' arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.registry import OpImpl


def check_bank(op: str, x: torch.Tensor, streams: int) -> int:
    """The stream width H of a bank ``x[T, n*H]`` of ``streams`` streams; a ValueError naming ``op`` if it is none."""
    if streams < 1 or x.dim() != 2 or x.shape[1] % streams:
        raise ValueError(f"{op}: a bank of shape {tuple(x.shape)} does not hold {streams} streams")
    return x.shape[1] // streams


def hc_act(d: torch.Tensor, streams: int) -> torch.Tensor:
    """``silu(d / n)`` (the contract)."""
    return F.silu(d / streams)


def hc_mix(z: torch.Tensor, xn: torch.Tensor, g: torch.Tensor | None,
           streams: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(u[T, H], inject[T, n] or None)`` (the contract)."""
    h = check_bank("hc_mix", xn, streams)
    t = xn.shape[0]
    if z.shape != xn.shape or (g is not None and g.shape != (t, streams)):
        raise ValueError(f"hc_mix: z {tuple(z.shape)}, xn {tuple(xn.shape)} and g "
                         f"{None if g is None else tuple(g.shape)} do not match [T, n*H] and [T, n]")
    u = (torch.sigmoid(z).view(t, streams, h) * xn.view(t, streams, h)).mean(dim=1)
    return u, (None if g is None else 2 * torch.sigmoid(g / streams))


def hc_write(x: torch.Tensor, y: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """``x_k + inject_k * y`` for every stream (the contract)."""
    t, streams = inject.shape
    h = check_bank("hc_write", x, streams)
    if y.shape != (t, h) or x.shape[0] != t:
        raise ValueError(f"hc_write: x {tuple(x.shape)}, y {tuple(y.shape)} and inject {tuple(inject.shape)} do "
                         f"not match [T, n*H], [T, H] and [T, n]")
    return x + (y.unsqueeze(1) * inject.unsqueeze(-1)).flatten(1)


OPS = [
    OpImpl(op="hc_act", name="torch_reference", fn=hc_act, priority=0),
    OpImpl(op="hc_mix", name="torch_reference", fn=hc_mix, priority=0),
    OpImpl(op="hc_write", name="torch_reference", fn=hc_write, priority=0),
]
