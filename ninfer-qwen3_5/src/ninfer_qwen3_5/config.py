"""The Qwen3.5 compact instance config: built from a Hugging Face config, stored in the artifact, parsed back.

:func:`compact_text_config` turns a source ``config.json`` (``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM`` or the ``*ForConditionalGeneration`` variants, whose text settings sit
under ``text_config``) into the artifact's ``text`` component config. :class:`Qwen35Config` parses
that compact config for the runtime.

Invariants:
- Every instance number comes from the config; a missing geometry field is an error naming it.
  Only fields HF itself defaults (rms_norm_eps, max_position_embeddings, partial_rotary_factor,
  the full-attention interval) fall back to HF's documented defaults.
- ``layer_types`` is always stored expanded (one entry per layer, ``linear_attention`` or
  ``full_attention``).
- ``architectures`` is ``["Qwen3_5ForCausalLM"]`` or ``["Qwen3_5MoeForCausalLM"]`` whatever the source
  class was: the artifact holds the text model; vision and MTP are separate components.
- For a ``*ForConditionalGeneration`` source, the top-level ``tie_word_embeddings`` decides tying (HF
  ties by the composite config, not ``text_config``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.errors import NInferError, NotSupportedError

DENSE = "Qwen3_5ForCausalLM"
MOE = "Qwen3_5MoeForCausalLM"
# source architectures[0] -> (text architecture, reads text settings from text_config)
SOURCE_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "Qwen3_5ForCausalLM": (DENSE, False),
    "Qwen3_5MoeForCausalLM": (MOE, False),
    "Qwen3_5ForConditionalGeneration": (DENSE, True),
    "Qwen3_5MoeForConditionalGeneration": (MOE, True),
}
LINEAR, FULL = "linear_attention", "full_attention"

# HF class defaults that a saved config may legitimately omit.
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "hidden_act": "silu",
                "attention_bias": False}
_GEOMETRY = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
             "linear_num_key_heads", "linear_num_value_heads")
_DENSE_FIELDS = ("intermediate_size",)
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


class Qwen35ConfigError(NInferError):
    """A Qwen3.5 config is missing a field or holds an inconsistent value; the message names it."""


def _require(src: Mapping[str, Any], key: str, where: str) -> Any:
    if src.get(key) is None:
        raise Qwen35ConfigError(f"{where} has no {key!r}")
    return src[key]


def _flag(src: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    """A boolean field: a JSON boolean, or ``default`` when absent (the string "false" is not False)."""
    v = src.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise Qwen35ConfigError(f"{where}: {key} must be a boolean (true or false), got {v!r}")
    return v


def _check_types(src: Mapping[str, Any], where: str, moe: bool) -> None:
    """The value types and ranges every later step relies on, named field by field: a corrupt or hand-edited
    config must fail here with its field, not later as a ZeroDivisionError or a str without .get."""
    def num(key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise Qwen35ConfigError(f"{where}: {key} must be a number, got {v!r}")
        return v

    for key in _GEOMETRY + (_MOE_FIELDS if moe else _DENSE_FIELDS) + ("max_position_embeddings",):
        v = src.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise Qwen35ConfigError(f"{where}: {key} must be an integer >= 1, got {v!r}")
    for key in ("rms_norm_eps", "rope_theta"):
        if src.get(key) is not None and not num(key, src[key]) > 0:
            raise Qwen35ConfigError(f"{where}: {key} must be > 0, got {src[key]!r}")
    rp = src.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, Mapping):
            raise Qwen35ConfigError(f"{where}: rope_parameters must be an object, got {rp!r}")
        if rp.get("rope_theta") is not None and not num("rope_parameters.rope_theta", rp["rope_theta"]) > 0:
            raise Qwen35ConfigError(f"{where}: rope_parameters.rope_theta must be > 0, got {rp['rope_theta']!r}")
        prf = rp.get("partial_rotary_factor")
        if prf is not None and not 0 < num("rope_parameters.partial_rotary_factor", prf) <= 1:
            raise Qwen35ConfigError(f"{where}: rope_parameters.partial_rotary_factor must be in (0, 1], got {prf!r}")
        section = rp.get("mrope_section")
        if section is not None and (not isinstance(section, list | tuple)
                                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in section)):
            raise Qwen35ConfigError(f"{where}: rope_parameters.mrope_section must be a list of integers, got "
                                    f"{section!r}")
    if src.get("rope_scaling") is not None and not isinstance(src["rope_scaling"], Mapping):
        raise Qwen35ConfigError(f"{where}: rope_scaling must be an object, got {src['rope_scaling']!r}")
    _flag(src, "tie_word_embeddings", where, False)
    if rp is not None:
        _flag(rp, "mrope_interleaved", f"{where}: rope_parameters", True)
    lt = src.get("layer_types")
    if lt is not None and (not isinstance(lt, list | tuple) or not all(isinstance(x, str) for x in lt)):
        raise Qwen35ConfigError(f"{where}: layer_types must be a list of strings, got {lt!r}")
    interval = src.get("full_attention_interval")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
        raise Qwen35ConfigError(f"{where}: full_attention_interval must be an integer >= 1, got {interval!r}")


def _rope(text: Mapping[str, Any], where: str) -> dict[str, Any]:
    rp = text.get("rope_parameters")
    if rp is None:  # pre-v5 config: rope_theta / partial_rotary_factor / rope_scaling at top level
        legacy = dict(text.get("rope_scaling") or {})
        rp = {"rope_type": legacy.get("rope_type", legacy.get("type", "default")),
              "rope_theta": text.get("rope_theta"),
              "partial_rotary_factor": text.get("partial_rotary_factor"),
              "mrope_section": legacy.get("mrope_section"),
              "mrope_interleaved": legacy.get("mrope_interleaved")}
    rope_type = rp.get("rope_type", "default")
    # "mrope" is the Qwen2-VL spelling of the same default frequencies.
    if rope_type not in ("default", "mrope"):
        raise NotSupportedError(f"{where}: rope_type {rope_type!r} is not supported (only default RoPE)")
    theta = _require(rp, "rope_theta", f"{where} rope_parameters")
    # HF's Qwen3_5TextConfig sets partial_rotary_factor to 0.25 when the config omits it.
    prf = rp.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    section = rp.get("mrope_section")
    return {"rope_type": "default", "rope_theta": float(theta),
            "partial_rotary_factor": float(0.25 if prf is None else prf),
            "mrope_section": None if section is None else [int(x) for x in section],
            "mrope_interleaved": _flag(rp, "mrope_interleaved", f"{where}: rope_parameters", True)}


def _layer_types(text: Mapping[str, Any], n: int, where: str) -> list[str]:
    lt = text.get("layer_types")
    if lt is None:
        interval = int(text.get("full_attention_interval", 4))  # HF default interval
        lt = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    lt = [str(x) for x in lt]
    if len(lt) != n:
        raise Qwen35ConfigError(f"{where}: layer_types has {len(lt)} entries for {n} layers")
    bad = sorted({x for x in lt if x not in (LINEAR, FULL)})
    if bad:
        raise NotSupportedError(f"{where}: layer types {bad} are not Qwen3.5 layer types")
    return lt


def compact_text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The artifact ``text`` component config for a source HF config (see module docstring)."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in SOURCE_ARCHITECTURES:
        raise Qwen35ConfigError(f"config architectures {archs} is not a Qwen3.5 source architecture")
    arch, nested = SOURCE_ARCHITECTURES[archs[0]]
    moe = arch == MOE
    where = f"{archs[0]} config" + (" text_config" if nested else "")
    text = _require(hf, "text_config", f"{archs[0]} config") if nested else hf
    if not isinstance(text, Mapping):
        raise Qwen35ConfigError(f"{where} must be an object, got {type(text).__name__}")
    _check_types(text, where, moe)
    out: dict[str, Any] = {"architectures": [arch], "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text"}
    for key in _GEOMETRY + (_MOE_FIELDS if moe else _DENSE_FIELDS):
        out[key] = int(_require(text, key, where))
    for key, default in _HF_DEFAULTS.items():
        out[key] = text.get(key, default) if text.get(key) is not None else default
    out["rms_norm_eps"] = float(out["rms_norm_eps"])
    out["max_position_embeddings"] = int(out["max_position_embeddings"])
    if out["hidden_act"] != "silu":
        raise NotSupportedError(f"{where}: hidden_act {out['hidden_act']!r} (Qwen3.5 uses silu)")
    if out["attention_bias"]:
        raise NotSupportedError(f"{where}: attention_bias=true is not a Qwen3.5 checkpoint")
    if text.get("attn_output_gate") is False or text.get("output_gate_type", "swish") != "swish":
        raise NotSupportedError(f"{where}: only the gated attention / silu GDN gate of Qwen3.5 is supported")
    if moe and text.get("mlp_only_layers"):
        raise NotSupportedError(f"{where}: mlp_only_layers {text['mlp_only_layers']} (Qwen3.5-MoE is all-MoE)")
    if text.get("layer_scale"):
        raise NotSupportedError(f"{where}: layer_scale is not supported")
    out["rope_parameters"] = _rope(text, where)
    out["layer_types"] = _layer_types(text, out["num_hidden_layers"], where)
    # HF default False for both the text and the composite config.
    out["tie_word_embeddings"] = _flag(hf if nested else text, "tie_word_embeddings", where, False)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = text.get(key, hf.get(key) if nested else None)
        if value is not None:
            out[key] = value
    for key in ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"):
        if key in text:
            out[key] = text[key]
    Qwen35Config.from_compact(out)  # the stored config must parse
    return out


@dataclass(frozen=True)
class Qwen35Config:
    """The parsed ``text`` component config. Invariants: ``len(layer_types) == num_layers``;
    Hv is a multiple of Hk; Nq a multiple of Nkv; MoE fields are set exactly when ``is_moe``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    conv_kernel: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    intermediate_size: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None

    @classmethod
    def from_compact(cls, c: Mapping[str, Any]) -> Qwen35Config:
        archs = c.get("architectures") or []
        if not archs or archs[0] not in (DENSE, MOE):
            raise Qwen35ConfigError(f"text config architectures {archs} is not {DENSE} or {MOE}")
        moe = archs[0] == MOE
        where = f"{archs[0]} text config"
        _check_types(c, where, moe)
        get = lambda k: _require(c, k, where)  # noqa: E731
        rope = get("rope_parameters")
        cfg = cls(
            architecture=archs[0], vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
            num_layers=int(get("num_hidden_layers")), num_heads=int(get("num_attention_heads")),
            num_kv_heads=int(get("num_key_value_heads")), head_dim=int(get("head_dim")),
            conv_kernel=int(get("linear_conv_kernel_dim")), linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            rms_norm_eps=float(get("rms_norm_eps")), max_position_embeddings=int(get("max_position_embeddings")),
            rope_theta=float(_require(rope, "rope_theta", where)),
            partial_rotary_factor=float(_require(rope, "partial_rotary_factor", where)),
            mrope_section=None if rope.get("mrope_section") is None else tuple(int(x) for x in rope["mrope_section"]),
            mrope_interleaved=_flag(rope, "mrope_interleaved", f"{where}: rope_parameters", True),
            layer_types=tuple(get("layer_types")), tie_word_embeddings=_flag(c, "tie_word_embeddings", where, False),
            intermediate_size=None if moe else int(get("intermediate_size")),
            num_experts=int(get("num_experts")) if moe else None,
            num_experts_per_tok=int(get("num_experts_per_tok")) if moe else None,
            moe_intermediate_size=int(get("moe_intermediate_size")) if moe else None,
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")) if moe else None)
        cfg._validate(where)
        return cfg

    def _validate(self, where: str) -> None:
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise Qwen35ConfigError(f"{where}: layer_types must list {LINEAR!r}/{FULL!r} for each of "
                                    f"{self.num_layers} layers")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise Qwen35ConfigError(f"{where}: linear_num_value_heads {self.linear_num_value_heads} is not a "
                                    f"multiple of linear_num_key_heads {self.linear_num_key_heads}")
        if self.num_heads % self.num_kv_heads:
            raise Qwen35ConfigError(f"{where}: num_attention_heads {self.num_heads} is not a multiple of "
                                    f"num_key_value_heads {self.num_kv_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise Qwen35ConfigError(f"{where}: rotary dim head_dim*partial_rotary_factor = {self.rotary_dim} "
                                    f"must be even and in (0, head_dim]")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise Qwen35ConfigError(f"{where}: num_experts_per_tok {self.num_experts_per_tok} not in "
                                    f"[1, num_experts={self.num_experts}]")

    # -- derived geometry ------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.architecture == MOE

    @property
    def key_dim(self) -> int:      # Hk * Dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:    # Hv * Dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:     # channels through the short conv: q, k and v
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        # HF: int(head_dim * partial_rotary_factor)
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)
