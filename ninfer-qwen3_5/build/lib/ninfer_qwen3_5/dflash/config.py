"""The DFlash / DFlash2 drafter's configuration: the z-lab checkpoint's ``config.json`` -> the artifact's compact
``dflash`` config -> :class:`DFlashConfig`, and whether a drafter fits its target.

Source (a Hugging Face folder in the z-lab format, both generations): a Qwen3-style decoder config
(``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``rms_norm_eps``, ``rope_theta`` or ``rope_parameters``, ``vocab_size``, ``layer_types``,
``sliding_window``, optional ``is_causal``) plus drafter fields read from the nested ``dflash_config`` first and
the top level second (the first generation keeps ``block_size`` at the top level, the second moved it):
``target_layer_ids``, ``mask_token_id``, ``block_size`` and the optional ``input_embedding_scale``,
``output_multiplier``, ``final_logit_softcapping``; DFlash2 (``architectures: DFlash2DraftModel``) adds
``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k``.

Compact config (stored as the ``dflash`` component's config and, because startup hands an architecture only its
text config, copied into the text config under :data:`TEXT_KEY`): the fields :class:`DFlashConfig` names, every
one explicit (per-layer ``causal`` and ``sliding_window`` lists, no defaults left to the reader).

Attention of a drafter layer: block queries see every context position and, inside the block, every block
position (``causal`` False) or those up to their own (``causal`` True: the first generation's sliding layers);
a layer with a ``sliding_window`` W sees only keys less than W positions away. A layer is causal when the
config says ``is_causal: true``, or, without ``is_causal``, when it is a ``sliding_attention`` layer.

Not supported (a :class:`~ninfer.errors.NotSupportedError` naming the field): attention biases, an activation
other than SiLU, RoPE scaling, a target layer past the second to last (the last one's HF hidden state is the
final-normed one, which no published drafter reads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer.errors import NInferError, NotSupportedError

#: ``architectures[0]`` of a z-lab drafter -> its generation.
GENERATIONS = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2}
#: The artifact component holding the drafter (both generations).
COMPONENT = "dflash"
#: The text config key carrying a copy of the compact drafter config (startup's parameter specs read it there).
TEXT_KEY = "dflash"


class DFlashConfigError(NInferError):
    """A drafter config misses a field, holds a bad value, or does not fit its target; the message names it."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The first generation's default when a config names no layers: one layer in the middle for a one-layer
    drafter, else ``num_draft_layers`` ids spread evenly (rounded) from layer 1 to layer ``L - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _int(v: Any, name: str, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise DFlashConfigError(f"drafter config field {name!r} must be an int >= {lo}, got {v!r}")
    return v


def _float(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DFlashConfigError(f"drafter config field {name!r} must be a number, got {v!r}")
    return float(v)


def compact_dflash_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The compact ``dflash`` config of a z-lab drafter's ``config.json`` (module docstring); every field is
    checked (:meth:`DFlashConfig.from_compact`)."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in GENERATIONS:
        raise DFlashConfigError(f"drafter config architectures {archs} is not one of {sorted(GENERATIONS)}")
    gen = GENERATIONS[archs[0]]
    nested = hf.get("dflash_config") or {}
    if not isinstance(nested, Mapping):
        raise DFlashConfigError(f"drafter config field 'dflash_config' must be an object, got {nested!r}")

    def value(name: str, default: Any = None) -> Any:
        return nested.get(name, hf.get(name, default))

    def need(name: str) -> Any:
        v = value(name)
        if v is None:
            raise DFlashConfigError(f"drafter config ({archs[0]}) has no {name!r} (neither in dflash_config nor "
                                    f"at the top level)")
        return v

    if hf.get("attention_bias"):
        raise NotSupportedError("a DFlash drafter with attention biases (attention_bias: true) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise NotSupportedError(f"a DFlash drafter with hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise NotSupportedError(f"a DFlash drafter with RoPE type {rope_type!r} is not supported (default only)")
    layers = _int(need("num_hidden_layers"), "num_hidden_layers")
    hidden = _int(need("hidden_size"), "hidden_size")
    heads = _int(need("num_attention_heads"), "num_attention_heads")
    ids = value("target_layer_ids")
    if ids is None:
        if hf.get("num_target_layers") is None:
            raise DFlashConfigError("drafter config has neither target_layer_ids nor num_target_layers")
        ids = default_target_layer_ids(_int(hf["num_target_layers"], "num_target_layers"), layers)
    types = hf.get("layer_types") or ["full_attention"] * layers
    if not isinstance(types, Sequence) or len(types) != layers:
        raise DFlashConfigError(f"drafter config layer_types must list {layers} layers, got {types!r}")
    is_causal = hf.get("is_causal")
    window = hf.get("sliding_window")
    softcap = value("final_logit_softcapping")
    out: dict[str, Any] = {
        "architectures": [archs[0]], "generation": gen, "hidden_size": hidden,
        "intermediate_size": need("intermediate_size"), "num_layers": layers, "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads", heads), "head_dim": hf.get("head_dim") or hidden // heads,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6), "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 1e4)),
        "vocab_size": need("vocab_size"), "num_target_layers": hf.get("num_target_layers"),
        "target_layer_ids": list(ids) if isinstance(ids, (list, tuple)) else ids,
        "block_size": value("block_size", 16), "mask_token_id": need("mask_token_id"),
        "causal": [bool(is_causal) if is_causal is not None else t == "sliding_attention" for t in types],
        "sliding_window": [window if t == "sliding_attention" else None for t in types],
        "input_embedding_scale": value("input_embedding_scale", 1.0),
        "output_multiplier": value("output_multiplier", 1.0),
        "final_logit_softcapping": softcap if softcap else None,
    }
    if gen == 2:
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            out[name] = need(name)
    DFlashConfig.from_compact(out)
    return out


@dataclass(frozen=True)
class DFlashConfig:
    """A checked compact drafter config. ``causal[i]`` / ``sliding_window[i]`` (None: none): layer i's attention
    (module docstring). ``conv_*`` and ``selector_*`` are 0 for the first generation."""

    generation: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    causal: tuple[bool, ...]
    sliding_window: tuple[int | None, ...]
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    num_target_layers: int | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def architecture(self) -> str:
        return "DFlash2DraftModel" if self.generation == 2 else "DFlashDraftModel"

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size if self.conv_group_size else 0

    @classmethod
    def from_compact(cls, c: Mapping[str, Any]) -> DFlashConfig:
        if not isinstance(c, Mapping):
            raise DFlashConfigError(f"a drafter config must be an object, got {type(c).__name__}")
        gen = c.get("generation")
        if gen not in (1, 2):
            raise DFlashConfigError(f"drafter config field 'generation' must be 1 or 2, got {gen!r}")
        get = c.get
        layers = _int(get("num_layers"), "num_layers")
        heads, kv = _int(get("num_heads"), "num_heads"), _int(get("num_kv_heads"), "num_kv_heads")
        if heads % kv:
            raise DFlashConfigError(f"drafter num_heads {heads} is not a multiple of num_kv_heads {kv}")
        head_dim = _int(get("head_dim"), "head_dim")
        if head_dim % 2:
            raise DFlashConfigError(f"drafter head_dim {head_dim} must be even (rotary pairs)")
        ids = get("target_layer_ids")
        if not isinstance(ids, (list, tuple)) or not ids:
            raise DFlashConfigError(f"drafter config field 'target_layer_ids' must be a non-empty list, got {ids!r}")
        ids = tuple(_int(i, "target_layer_ids", 0) for i in ids)
        causal, window = get("causal"), get("sliding_window")
        if not isinstance(causal, (list, tuple)) or len(causal) != layers or not all(isinstance(x, bool) for x in causal):
            raise DFlashConfigError(f"drafter config field 'causal' must list {layers} booleans, got {causal!r}")
        if not isinstance(window, (list, tuple)) or len(window) != layers:
            raise DFlashConfigError(f"drafter config field 'sliding_window' must list {layers} entries, got {window!r}")
        window = tuple(None if w is None else _int(w, "sliding_window") for w in window)
        block = _int(get("block_size"), "block_size", 2)
        softcap = get("final_logit_softcapping")
        kw: dict[str, Any] = {}
        hidden = _int(get("hidden_size"), "hidden_size")
        if gen == 2:
            kw = {name: _int(get(name), name) for name in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                          "selector_top_k")}
            if hidden % kw["conv_group_size"]:
                raise DFlashConfigError(f"drafter hidden_size {hidden} is not a multiple of conv_group_size "
                                        f"{kw['conv_group_size']}")
        ntl = get("num_target_layers")
        return cls(
            generation=gen, hidden_size=hidden, intermediate_size=_int(get("intermediate_size"), "intermediate_size"),
            num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            rms_norm_eps=_float(get("rms_norm_eps"), "rms_norm_eps"), rope_theta=_float(get("rope_theta"), "rope_theta"),
            vocab_size=_int(get("vocab_size"), "vocab_size"), target_layer_ids=ids, block_size=block,
            mask_token_id=_int(get("mask_token_id"), "mask_token_id", 0), causal=tuple(causal), sliding_window=window,
            input_embedding_scale=_float(get("input_embedding_scale"), "input_embedding_scale"),
            output_multiplier=_float(get("output_multiplier"), "output_multiplier"),
            final_logit_softcapping=None if softcap is None else _float(softcap, "final_logit_softcapping"),
            num_target_layers=None if ntl is None else _int(ntl, "num_target_layers"), **kw)

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """A clear error unless this drafter fits a target of that hidden size, vocabulary and depth."""
        if self.hidden_size != hidden_size:
            raise DFlashConfigError(f"the drafter's hidden_size {self.hidden_size} does not match the target's "
                                    f"{hidden_size}: a DFlash drafter works at its target's hidden size")
        if self.vocab_size != vocab_size:
            raise DFlashConfigError(f"the drafter's vocab_size {self.vocab_size} does not match the target's "
                                    f"{vocab_size}: it reads the target's embedding and LM head")
        if not self.mask_token_id < vocab_size:
            raise DFlashConfigError(f"the drafter's mask_token_id {self.mask_token_id} is outside the target's "
                                    f"vocabulary of {vocab_size}")
        if self.num_target_layers is not None and self.num_target_layers != num_layers:
            raise DFlashConfigError(f"the drafter was made for a target of {self.num_target_layers} layers; this "
                                    f"target has {num_layers}")
        bad = [i for i in self.target_layer_ids if i >= num_layers]
        if bad:
            raise DFlashConfigError(f"the drafter's target_layer_ids {list(self.target_layer_ids)} name layer(s) "
                                    f"{bad} of a target with {num_layers} layers (0..{num_layers - 1})")
        if num_layers - 1 in self.target_layer_ids:
            raise NotSupportedError(f"a drafter reading the target's last layer ({num_layers - 1}, whose hidden state "
                                    f"is the final-normed one) is not supported")
