"""Logical parameter names and shapes (the artifact's binding names), from the compact config only.

=============================  ====================  ==============================================
name                           shape                 meaning
=============================  ====================  ==============================================
text/embed                     [V, H]                token embedding
text/layers/{i}/input_norm     [H]                   RMSNorm weight before attention (plain w)
text/layers/{i}/attention/qkv  [(Nq + 2 Nkv) D, H]   q_proj, k_proj, v_proj rows stacked
text/layers/{i}/attention/out  [H, Nq D]             o_proj
text/layers/{i}/post_norm      [H]                   RMSNorm weight before the MLP
text/layers/{i}/mlp/gate_up    [2 I, H]              gate_proj rows, then up_proj rows
text/layers/{i}/mlp/down       [H, I]                down_proj
text/norm                      [H]                   final RMSNorm weight
text/lm_head                   [V, H]                the same object as text/embed when tied
=============================  ====================  ==============================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.contracts.architecture import ParameterSpec
from ninfer.contracts.features import StartupFeatures
from ninfer.errors import NotSupportedError

from ninfer_llama_mini.config import LlamaMiniConfig


def layer_prefix(i: int) -> str:
    return f"text/layers/{i}"


def text_shapes(cfg: LlamaMiniConfig) -> dict[str, tuple[int, ...]]:
    V, H, I, D = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    out = {"text/embed": (V, H), "text/norm": (H,), "text/lm_head": (V, H)}
    for i in range(cfg.num_layers):
        p = layer_prefix(i)
        out.update({f"{p}/input_norm": (H,), f"{p}/post_norm": (H,),
                    f"{p}/attention/qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, H),
                    f"{p}/attention/out": (H, cfg.num_heads * D),
                    f"{p}/mlp/gate_up": (2 * I, H), f"{p}/mlp/down": (H, I)})
    return out


def parameter_specs(config: Mapping[str, Any], features: StartupFeatures) -> list[ParameterSpec]:
    """The parameters the features bind: text only (this example has no vision tower or draft model)."""
    if features.vision or features.speculative is not None:
        raise NotSupportedError("LlamaMini runs text only (no vision, no speculative decoding)")
    shapes = text_shapes(LlamaMiniConfig.from_compact(config))
    return [ParameterSpec(name=name, shape=shape, component="text") for name, shape in shapes.items()]
