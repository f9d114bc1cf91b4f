"""Torch reference ops for quantized weights (CPU): the weight-reading ops, for every quantized format this
engine implements, keyed by that stored format (:class:`~ninfer.ops.registry.OpImpl.weight_formats`).

Invariant: each op equals its dense reference with the weight replaced by its decoded values
(:meth:`~ninfer.quant.PackedWeight.dequantize`, ``scale * code`` computed in fp32, or fp64 for fp64
activations), the GEMMs running in the wider of x's dtype and fp32, and the output rounded to x's dtype as the
dense op rounds it, except that a weight marked ``activations="a8"`` runs the A8 product
(:mod:`ninfer.ops.reference.a8`: activations quantized to E4M3 per token). A weight argument may also be a dense tensor (a layer whose other weight is packed).
Decoding happens per call and per expert: a reference for testing kernels and checking accuracy, not a
fast path.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ninfer.ops.contracts import SharedExpert
from ninfer.ops.reference import a8 as _a8
from ninfer.ops.reference import moe as dense_moe
from ninfer.ops.reference import norm as dense_norm
from ninfer.ops.reference.activation import silu_and_mul
from ninfer.ops.registry import OpImpl
from ninfer.quant import QUANTIZED_FORMATS, PackedWeight


def _wide(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _values(weight: torch.Tensor | PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize(dtype) if isinstance(weight, PackedWeight) else weight.to(dtype)


def linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x @ decode(weight).T`` in the wider of x's dtype and fp32, rounded to x.dtype."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: x has {x.shape[-1]} input features, weight expects {weight.shape[-1]}")
    if weight.activations == "a8":  # every use allows 8-bit activations: the A8 product (ops/reference/a8.py)
        return _a8.linear_a8(x, weight)
    wide = _wide(x)
    return torch.nn.functional.linear(x.to(wide), _values(weight, wide)).to(x.dtype)


def logits(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    return linear(x, weight).float()


def add_rms_norm_unit_offset_linear(x, residual, norm_weight, eps, weight: PackedWeight):
    normed, new_residual = dense_norm.add_rms_norm_unit_offset(x, residual, norm_weight, eps)
    return linear(normed, weight), normed, new_residual


def add_rms_norm_unit_offset_swiglu(x, residual, norm_weight, eps, gate_up: PackedWeight):
    if gate_up.shape[0] % 2:
        raise ValueError(f"add_rms_norm_unit_offset_swiglu: gate_up has {gate_up.shape[0]} rows, not [2I, N]")
    y, normed, new_residual = add_rms_norm_unit_offset_linear(x, residual, norm_weight, eps, gate_up)
    return silu_and_mul(y), normed, new_residual


class DecodedBank:
    """A bank that decodes one expert when indexed: what the dense reference reads (shape, dtype, [e])."""

    def __init__(self, bank: torch.Tensor | PackedWeight) -> None:
        self.bank = bank
        self.shape = tuple(bank.shape)
        self.dtype = torch.float32

    def __getitem__(self, expert: int) -> torch.Tensor:
        return _values(self.bank[expert], torch.float32)


def moe_experts(x, weights, ids, gate_up, down, *, shared: SharedExpert | None = None):
    """The dense reference with each used expert decoded to fp32 (and a packed shared ``down`` decoded)."""
    if shared is not None and isinstance(shared.down, PackedWeight):
        shared = replace(shared, down=shared.down.dequantize(torch.float32))
    return dense_moe.moe_experts(x, weights, ids, DecodedBank(gate_up), DecodedBank(down), shared=shared)


_FORMATS = frozenset(QUANTIZED_FORMATS)
_CPU = frozenset({"cpu"})
OPS = [OpImpl(op=name, name="torch_reference_dequant", fn=fn, devices=_CPU, weight_formats=_FORMATS)
       for name, fn in (("linear", linear), ("logits", logits),
                        ("add_rms_norm_unit_offset_linear", add_rms_norm_unit_offset_linear),
                        ("add_rms_norm_unit_offset_swiglu", add_rms_norm_unit_offset_swiglu),
                        ("moe_experts", moe_experts))]
