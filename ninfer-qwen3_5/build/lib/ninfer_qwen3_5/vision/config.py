"""The compact vision config: the tower's instance numbers and the placeholder token ids, from a HF
``*ForConditionalGeneration`` config.

The converter stores it twice: as the ``vision`` component's config, and under the text config's
``vision_config`` key, because ``parameter_specs``, ``profile`` and the Program only ever see the text config
(the MTP head's keys are copied the same way). An artifact whose text config lacks the key has no tower the
runtime can bind (a text-only source, or one converted before the key existed).

Refused (naming the field): another activation than ``gelu_pytorch_tanh``, deepstack layers, a non-square or
non-integer patch, an output width other than the text hidden size, a position table that is not a square grid,
a head width that the 2-D rotary cannot split (it needs a multiple of 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import isqrt
from typing import Any

from ninfer.errors import NotSupportedError

from ninfer_qwen3_5.config import Qwen35ConfigError

DENSE_VISION, MOE_VISION = "Qwen3_5Vision", "Qwen3_5MoeVision"
# HF Qwen3_5VisionConfig / Qwen3_5Config defaults a saved config may omit.
_DEFAULTS: dict[str, Any] = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                             "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                             "out_hidden_size": 3584, "num_position_embeddings": 2304}
_TOKENS: dict[str, int] = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                           "vision_end_token_id": 248054}
_ROPE_THETA = 10000.0


def compact_vision_config(hf: Mapping[str, Any], text_hidden: int, moe: bool) -> dict[str, Any]:
    """The compact config of the tower of the composite HF config ``hf`` (its ``vision_config`` and the
    top-level token ids), checked against the text model's hidden size."""
    v = hf.get("vision_config")
    if not isinstance(v, Mapping):
        raise Qwen35ConfigError(f"vision_config must be an object, got {type(v).__name__}")
    out: dict[str, Any] = {"architectures": [MOE_VISION if moe else DENSE_VISION]}
    for key, default in _DEFAULTS.items():
        value = v.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Qwen35ConfigError(f"vision_config.{key} must be an integer >= 1, got {value!r}")
        out[key] = value
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise NotSupportedError(f"vision_config.hidden_act {act!r} (Qwen3.5's tower uses gelu_pytorch_tanh)")
    if v.get("deepstack_visual_indexes"):
        raise NotSupportedError(f"vision_config.deepstack_visual_indexes {v['deepstack_visual_indexes']} "
                                f"(Qwen3.5 has no deepstack)")
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, Mapping) or rope.get("rope_type", "axial") != "axial":
        raise NotSupportedError(f"vision_config.rope_parameters {rope!r}: only axial rope is supported")
    theta = rope.get("rope_theta", _ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise Qwen35ConfigError(f"vision_config.rope_parameters.rope_theta must be > 0, got {theta!r}")
    out["rope_theta"] = float(theta)
    for key, default in _TOKENS.items():
        value = hf.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Qwen35ConfigError(f"{key} must be an integer >= 0, got {value!r}")
        out[key] = value
    if out["out_hidden_size"] != text_hidden:
        raise Qwen35ConfigError(f"vision_config.out_hidden_size {out['out_hidden_size']} must equal the text "
                                f"hidden_size {text_hidden}")
    VisionConfig.from_compact(out)   # the stored config must parse
    return out


@dataclass(frozen=True)
class VisionConfig:
    """The parsed compact vision config. Invariants: ``hidden_size`` is ``num_heads`` heads of a width that is a
    multiple of 4; ``num_position_embeddings`` is a square (the learned ``grid_side x grid_side`` table)."""

    architecture: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_compact(cls, c: Mapping[str, Any]) -> VisionConfig:
        archs = c.get("architectures") or []
        if not archs or archs[0] not in (DENSE_VISION, MOE_VISION):
            raise Qwen35ConfigError(f"vision config architectures {archs} is not {DENSE_VISION} or {MOE_VISION}")
        fields = {}
        for key in (*_DEFAULTS, *_TOKENS):
            value = c.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key in _TOKENS else 1):
                raise Qwen35ConfigError(f"vision config {key} must be an integer, got {value!r}")
            fields[key] = value
        theta = c.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise Qwen35ConfigError(f"vision config rope_theta must be > 0, got {theta!r}")
        cfg = cls(architecture=archs[0], rope_theta=float(theta), **fields)
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise Qwen35ConfigError(f"vision config: hidden_size {cfg.hidden_size} must be num_heads "
                                    f"{cfg.num_heads} heads of a width divisible by 4 (the 2-D rotary halves it "
                                    f"twice)")
        if isqrt(cfg.num_position_embeddings) ** 2 != cfg.num_position_embeddings:
            raise Qwen35ConfigError(f"vision config: num_position_embeddings {cfg.num_position_embeddings} is not a "
                                    f"square grid")
        if cfg.image_token_id == cfg.video_token_id:
            raise Qwen35ConfigError(f"vision config: image_token_id and video_token_id are both "
                                    f"{cfg.image_token_id}")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values of one input row: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output embedding (spatial_merge_size squared)."""
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def grid_side(self) -> int:
        """The learned position table's side."""
        return isqrt(self.num_position_embeddings)
