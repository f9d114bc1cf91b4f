"""Torch references of the two GELUs of the vision tower: ``gelu_tanh`` (the blocks' MLP) and ``gelu_erf`` (the
merger, the exact one). Both in fp32, rounded once to the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ninfer.ops.registry import OpImpl


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.float(), approximate="tanh").to(x.dtype)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.float()).to(x.dtype)


OPS = [OpImpl(op="gelu_tanh", name="torch_reference", fn=gelu_tanh, priority=0),
       OpImpl(op="gelu_erf", name="torch_reference", fn=gelu_erf, priority=0)]
