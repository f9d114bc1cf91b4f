"""The ``mtp`` component's parameters: their specs, loading them from an artifact, and preparing them.

The converter stores the checkpoint's ``mtp.*`` head as the artifact component ``mtp`` (config
``{"architectures": ["Qwen3_5MTP" | "Qwen3_5MoeMTP"], "mtp_num_hidden_layers": n,
"mtp_use_dedicated_embeddings": bool}``, see :mod:`ninfer_qwen3_5.mapping`); its own parameters are
``mtp/fc``, the three ``mtp/*norm*`` weights and one full-attention decoder layer ``mtp/layers/0/...`` with the
text layers' suffixes (:func:`ninfer_qwen3_5.parameters.mtp_shapes`). The embedding and LM head are the
target's ``text/embed`` / ``text/lm_head``: they are never loaded twice.

Supported: exactly one MTP layer and shared embeddings (every published Qwen3.5 checkpoint); anything else is
a clear :class:`~ninfer.errors.NotSupportedError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from ninfer.contracts.architecture import ParameterSpec
from ninfer.contracts.program import ProgramError
from ninfer.errors import NotSupportedError

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.parameters import mtp_shapes

COMPONENT = "mtp"


def mtp_num_layers(mtp_config: Mapping[str, Any]) -> int:
    """The MTP layer count of an ``mtp`` component config; only 1 is supported."""
    n = mtp_config.get("mtp_num_hidden_layers")
    if n != 1:
        raise NotSupportedError(f"Qwen3.5 MTP with mtp_num_hidden_layers={n!r} is not supported (only 1)")
    if mtp_config.get("mtp_use_dedicated_embeddings", False):
        raise NotSupportedError("Qwen3.5 MTP with dedicated embeddings is not supported (only the shared ones)")
    return 1


def mtp_parameter_specs(text_config: Mapping[str, Any], mtp_config: Mapping[str, Any] | None = None
                        ) -> list[ParameterSpec]:
    """Every parameter of the ``mtp`` component (component ``"mtp"``), shapes from the text config.
    ``mtp_config`` None: the text config's own ``mtp_*`` keys (the converter copies them into the compact text
    config too, so ``parameter_specs`` can add these specs from the one config it is given)."""
    cfg = Qwen35Config.from_compact(text_config)
    shapes = mtp_shapes(cfg, mtp_num_layers(text_config if mtp_config is None else mtp_config))
    return [ParameterSpec(name=n, shape=s, component=COMPONENT) for n, s in shapes.items()]


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
