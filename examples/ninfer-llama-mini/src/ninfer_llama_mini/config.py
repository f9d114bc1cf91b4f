"""The compact config: what the artifact's ``text`` component stores about one instance, and its parsed form.

The source mapping turns a Hugging Face ``config.json`` into the compact config once, at conversion
(:func:`compact_config`); the runtime parses it back (:meth:`LlamaMiniConfig.from_compact`) and derives
everything else. A feature this example does not implement is refused at conversion, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ninfer.conversion.errors import SourceError
from ninfer.errors import NotSupportedError

#: ``architectures[0]`` of the artifacts this plugin writes and runs (its ArchitectureSpec.name).
ARCHITECTURE = "LlamaMiniForCausalLM"
#: ``architectures[0]`` of the Hugging Face checkpoints it converts.
SOURCE_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class LlamaMiniConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_compact(cls, config: Mapping[str, Any]) -> LlamaMiniConfig:
        return cls(**{f.name: config[f.name] for f in fields(cls)})


def compact_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The compact config of a ``LlamaForCausalLM`` config.json (transformers 4 or 5 spelling of RoPE)."""
    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise SourceError(f"config.json has no {key!r}")
        return hf[key]

    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, supported) != supported:
            raise NotSupportedError(f"config.json: {key}={hf[key]!r} is not supported (only {supported!r})")
    rope = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e4)}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotSupportedError(f"config.json: rope_type {rope_type!r} is not supported (only default RoPE)")
    heads = int(need("num_attention_heads"))
    cfg = LlamaMiniConfig(
        vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")), num_layers=int(need("num_hidden_layers")),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or need("hidden_size") // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))
    return {"architectures": [ARCHITECTURE], **asdict(cfg)}
