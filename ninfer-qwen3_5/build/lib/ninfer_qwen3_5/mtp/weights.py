"""The ``mtp`` component's parameters: their specs, loading them from an artifact, and preparing them.

The converter stores the checkpoint's ``mtp.*`` head as the artifact component ``mtp`` (config
``{"architectures": ["Qwen3_5MTP" | "Qwen3_5MoeMTP"], "mtp_num_hidden_layers": n,
"mtp_use_dedicated_embeddings": bool}``, see :mod:`ninfer_qwen3_5.mapping`); its own parameters are
``mtp/fc``, the three ``mtp/*norm*`` weights and one full-attention decoder layer ``mtp/layers/0/...`` with the
text layers' suffixes (:func:`ninfer_qwen3_5.parameters.mtp_shapes`). The embedding and LM head are the
target's ``text/embed`` / ``text/lm_head``: they are never loaded twice.

Supported: exactly one MTP layer and shared embeddings (every published Qwen3.5 checkpoint); anything else is
a clear :class:`~ninfer.errors.NotSupportedError`. The specs themselves live in
:mod:`ninfer_qwen3_5.parameters` (startup's ``parameter_specs`` adds them), re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from ninfer.contracts.program import ProgramError

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.parameters import MTP_COMPONENT as COMPONENT
from ninfer_qwen3_5.parameters import mtp_num_layers, mtp_parameter_specs, mtp_shapes

__all__ = ["COMPONENT", "load_mtp_weights", "mtp_num_layers", "mtp_parameter_specs", "prepare_mtp_weights"]


def load_mtp_weights(reader, device: str | torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(mtp component config, its weights on device)`` from an open ``ArtifactReader`` (a
    :class:`~ninfer.artifact.binder.MissingComponentError` when the artifact has no ``mtp`` component). The
    weights are the stored encoding, as ``load_weights`` hands the text ones to ``ProgramInit``."""
    from ninfer.artifact import load_weights

    text_config = reader.component("text").config
    mtp_config = dict(reader.component(COMPONENT).config)
    return mtp_config, load_weights(reader, mtp_parameter_specs(text_config, mtp_config), device)


def prepare_mtp_weights(cfg: Qwen35Config, weights: Mapping[str, torch.Tensor], dtype: torch.dtype
                        ) -> dict[str, torch.Tensor]:
    """The MTP parameters checked (present, shape, floating point) and cast to the activation ``dtype``
    (a weight stored in another float dtype is cast once, as the text model does)."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in mtp_shapes(cfg, 1).items():
        w = weights.get(name)
        if w is None:
            raise ProgramError(f"Qwen3.5 MTP weights lack parameter {name!r}")
        if tuple(w.shape) != shape:
            raise ProgramError(f"parameter {name!r} has shape {tuple(w.shape)}, expected {shape}")
        if not w.dtype.is_floating_point:
            raise ProgramError(f"parameter {name!r} is {w.dtype}; Qwen3.5 weights must be floating point")
        out[name] = w if w.dtype == dtype else w.to(dtype)
    return out
