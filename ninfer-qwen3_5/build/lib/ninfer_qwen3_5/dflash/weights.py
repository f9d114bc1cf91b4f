"""The ``dflash`` component's weights: loading them from an artifact and preparing them for the drafter.

Preparation (what :class:`~ninfer_qwen3_5.dflash.drafter.DFlashDrafter` computes with): every parameter checked
(present, shape, floating point); matrices cast to the activation dtype; the plain RMSNorm weights ``w`` of the
z-lab checkpoint (``hidden_norm``, ``norm``, the layers' norms, ``q_norm`` / ``k_norm``) stored as fp32 offsets
``w - 1`` so the core's unit-offset norm ops compute ``x_normed * (1 + (w - 1))``, which is ``x_normed * w``
exactly whenever ``w - 1`` is exact in fp32 (any bf16 weight of magnitude at least 2^-16); the conv kernels
and codebooks stay fp32 or the activation dtype as the drafter reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from ninfer.contracts.program import ProgramError

from ninfer_qwen3_5.dflash.config import COMPONENT, DFlashConfig
from ninfer_qwen3_5.dflash.parameters import dflash_parameter_specs, dflash_shapes

_PLAIN_NORMS = ("/hidden_norm", "/norm", "/input_norm", "/post_norm", "/q_norm", "/k_norm")


def load_dflash_weights(reader, device: str | torch.device) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """``(drafter config, its weights on device)`` from an open ``ArtifactReader`` (a
    :class:`~ninfer.artifact.binder.MissingComponentError` when the artifact has no ``dflash`` component); the
    weights are the stored encoding."""
    from ninfer.artifact import load_weights

    cfg = DFlashConfig.from_compact(reader.component(COMPONENT).config)
    return cfg, load_weights(reader, dflash_parameter_specs(cfg), device)


def prepare_dflash_weights(cfg: DFlashConfig, weights: Mapping[str, Any], dtype: torch.dtype
                           ) -> dict[str, torch.Tensor]:
    """The drafter's parameters checked and prepared (module docstring); other names in ``weights`` are ignored."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in dflash_shapes(cfg).items():
        w = weights.get(name)
        if w is None:
            raise ProgramError(f"DFlash drafter weights lack parameter {name!r}")
        if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
            raise ProgramError(f"parameter {name!r} must be a floating-point tensor (the drafter is stored as "
                               f"converted, unquantized), got {getattr(w, 'dtype', type(w).__name__)}")
        if tuple(w.shape) != shape:
            raise ProgramError(f"parameter {name!r} has shape {tuple(w.shape)}, expected {shape}")
        if name.endswith(_PLAIN_NORMS):
            out[name] = w.float() - 1.0
        else:
            out[name] = w if w.dtype == dtype else w.to(dtype)
    return out


__all__ = ["COMPONENT", "load_dflash_weights", "prepare_dflash_weights"]
