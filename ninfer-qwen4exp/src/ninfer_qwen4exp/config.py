"""The Qwen4-Exp compact instance config: built from a Hugging Face config, stored in the artifact, parsed back.

:func:`compact_text_config` turns a source ``config.json`` (``Qwen4ExpForCausalLM``, or
``Qwen4ExpForConditionalGeneration`` whose text settings sit under ``text_config``) into the artifact's ``text``
component config; :class:`Qwen4ExpConfig` parses that for the runtime.

Invariants:
- Every geometry number comes from the config; a missing one is an error naming it. Fields transformers gives a
  class default (the hyper-connection, PLE and n-gram settings, ``rms_norm_eps``, ...) fall back to that default.
  An omitted ``rope_parameters.partial_rotary_factor`` is 1.0 (full rotary), as the Qwen4-Exp rotary of
  transformers 5.17 and 5.24 reads it.
- ``layer_types`` is stored expanded, one entry per layer: ``linear_attention`` or ``indexed_attention``. Every
  attention layer of Qwen4-Exp carries the QSA indexer; the source spellings ``full_attention`` (the released
  checkpoint), ``qwen_sparse_attention`` (transformers 5.17) and ``indexed_attention`` (5.24) all mean it, so the
  QSA fields are required whenever a layer attends.
- ``architectures`` is ``["Qwen4ExpForCausalLM"]`` whatever the source class: the artifact holds the text model.
- ``ple_layer_ids`` keeps the checkpoint's one-based numbering (``ple_layers`` is the zero-based view); PLE sits only
  on ``linear_attention`` layers, and needs ``eos_token_id`` (the n-gram padding token, the first id of a list).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.errors import NInferError, NotSupportedError
from ninfer_qwen3_5.config import FULL, LINEAR, MOE, Qwen35Config

ARCHITECTURE = "Qwen4ExpForCausalLM"
# source architectures[0] -> reads its text settings from text_config
SOURCE_ARCHITECTURES: dict[str, bool] = {"Qwen4ExpForCausalLM": False, "Qwen4ExpForConditionalGeneration": True}
INDEXED = "indexed_attention"
_ATTENTION_SPELLINGS = ("full_attention", "qwen_sparse_attention", "indexed_attention")

_GEOMETRY = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
             "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size")
# transformers' Qwen4ExpTextConfig class defaults (a saved config may omit them).
_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "hidden_act": "silu", "hc_count": 4, "hc_lowrank": 320,
    "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128, "seed": 1234, "split_ngram_parts": 512, "norm_topk_prob": True,
    "tie_word_embeddings": False, "attention_bias": False}
_INTS = ("hc_count", "hc_lowrank", "ple_conv_kernel_size", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base",
         "make_ngram_vocab_size_divisible_by", "split_ngram_parts", "max_position_embeddings")
_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


class Qwen4ExpConfigError(NInferError):
    """A Qwen4-Exp config is missing a field or holds an inconsistent value; the message names it."""


def _tie(c: Mapping[str, Any], where: str) -> bool:
    """The stored config's tie_word_embeddings: a JSON boolean (default False)."""
    v = c.get("tie_word_embeddings", False)
    if not isinstance(v, bool):
        raise Qwen4ExpConfigError(f"{where}: tie_word_embeddings must be a boolean (true or false), got {v!r}")
    return v


def _int(src: Mapping[str, Any], key: str, where: str, *, minimum: int = 1) -> int:
    v = src.get(key)
    if v is None:
        raise Qwen4ExpConfigError(f"{where} has no {key!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise Qwen4ExpConfigError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _rope(text: Mapping[str, Any], where: str) -> dict[str, Any]:
    rp = text.get("rope_parameters")
    if rp is None:
        raise Qwen4ExpConfigError(f"{where} has no 'rope_parameters'")
    if not isinstance(rp, Mapping):
        raise Qwen4ExpConfigError(f"{where}: rope_parameters must be an object, got {rp!r}")
    rope_type = rp.get("rope_type", "default")
    if rope_type not in ("default", "mrope"):
        raise NotSupportedError(f"{where}: rope_type {rope_type!r} is not supported (only default RoPE)")
    theta, prf = rp.get("rope_theta"), rp.get("partial_rotary_factor", 1.0)
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", prf)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise Qwen4ExpConfigError(f"{where}: rope_parameters.{key} must be a number > 0, got {value!r}")
    if prf > 1:
        raise Qwen4ExpConfigError(f"{where}: rope_parameters.partial_rotary_factor must be <= 1, got {prf!r}")
    section = rp.get("mrope_section")
    if section is not None and (not isinstance(section, list | tuple)
                                or not all(isinstance(x, int) and not isinstance(x, bool) for x in section)):
        raise Qwen4ExpConfigError(f"{where}: rope_parameters.mrope_section must be a list of integers, got {section!r}")
    return {"rope_type": "default", "rope_theta": float(theta), "partial_rotary_factor": float(prf),
            "mrope_section": None if section is None else [int(x) for x in section]}


def _layer_types(text: Mapping[str, Any], n: int, where: str) -> list[str]:
    lt = text.get("layer_types")
    if lt is None:
        interval = text.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise Qwen4ExpConfigError(f"{where}: full_attention_interval must be an integer >= 1, got {interval!r}")
        lt = [INDEXED if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if not isinstance(lt, list | tuple) or not all(isinstance(x, str) for x in lt):
        raise Qwen4ExpConfigError(f"{where}: layer_types must be a list of strings, got {lt!r}")
    if len(lt) != n:
        raise Qwen4ExpConfigError(f"{where}: layer_types has {len(lt)} entries for {n} layers")
    bad = sorted({x for x in lt if x != LINEAR and x not in _ATTENTION_SPELLINGS})
    if bad:
        raise NotSupportedError(f"{where}: layer types {bad} are not Qwen4-Exp layer types")
    return [LINEAR if x == LINEAR else INDEXED for x in lt]


def _eos(text: Mapping[str, Any], hf: Mapping[str, Any], nested: bool) -> int | None:
    eos = text.get("eos_token_id", hf.get("eos_token_id") if nested else None)
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    return eos


def compact_text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The artifact ``text`` component config for a source HF config (see the module docstring)."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in SOURCE_ARCHITECTURES:
        raise Qwen4ExpConfigError(f"config architectures {archs} is not a Qwen4-Exp source architecture")
    nested = SOURCE_ARCHITECTURES[archs[0]]
    where = f"{archs[0]} config" + (" text_config" if nested else "")
    text = hf.get("text_config") if nested else hf
    if not isinstance(text, Mapping):
        raise Qwen4ExpConfigError(f"{where} must be an object, got {type(text).__name__}")
    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": "qwen4_exp_text"}
    for key in _GEOMETRY:
        out[key] = _int(text, key, where)
    for key, default in _DEFAULTS.items():
        out[key] = text[key] if text.get(key) is not None else default
    if nested:   # the composite config decides tying (transformers ties by it)
        out["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
    if not isinstance(out.get("tie_word_embeddings", False), bool):   # the string "false" is not False
        raise Qwen4ExpConfigError(f"{where}: tie_word_embeddings must be a boolean (true or false), got "
                                  f"{out['tie_word_embeddings']!r}")
    for key in _INTS:
        _int(out, key, where)
    eps = out["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise Qwen4ExpConfigError(f"{where}: rms_norm_eps must be a number > 0, got {eps!r}")
    out["rms_norm_eps"] = float(eps)
    if out.pop("hidden_act") != "silu":
        raise NotSupportedError(f"{where}: hidden_act {text.get('hidden_act')!r} (Qwen4-Exp uses silu)")
    if out.pop("attention_bias"):
        raise NotSupportedError(f"{where}: attention_bias=true is not a Qwen4-Exp checkpoint")
    if out.pop("norm_topk_prob") is not True:
        raise NotSupportedError(f"{where}: norm_topk_prob=false (only the renormalised top-k router is supported)")
    gate = text.get("output_gate_type") or "silu"
    if gate not in ("silu", "sigmoid"):
        raise NotSupportedError(f"{where}: output_gate_type {gate!r} (only sigmoid or silu)")
    out["output_gate_type"] = gate
    out["rope_parameters"] = _rope(text, where)
    out["layer_types"] = _layer_types(text, out["num_hidden_layers"], where)
    ple = text.get("ple_layer_ids") or []
    if not isinstance(ple, list | tuple) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ple):
        raise Qwen4ExpConfigError(f"{where}: ple_layer_ids must be a list of integers, got {ple!r}")
    out["ple_layer_ids"] = sorted(set(ple))
    out["ple_embed_dim"] = text.get("ple_embed_dim") or out["hidden_size"]
    for key in _QSA:
        if text.get(key) is not None:
            out[key] = text[key]
    out["eos_token_id"] = _eos(text, hf, nested)
    for key in ("bos_token_id", "pad_token_id", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"):
        if text.get(key) is not None:
            out[key] = text[key]
    Qwen4ExpConfig.from_compact(out)   # the stored config must parse
    return out


@dataclass(frozen=True)
class Qwen4ExpConfig:
    """The parsed ``text`` component config. Invariants: ``len(layer_types) == num_layers``; PLE layers are
    ``linear_attention`` layers and ``eos_token_id`` is set when there is one; the QSA fields are set when any layer
    attends, with ``indexer_budget % indexer_compress_ratio == 0`` and ``rotary_dim <= indexer_head_dim``."""

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
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    output_gate_type: str
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    ngram_vocab_divisor: int
    seed: int
    eos_token_id: int | None
    indexer_heads: int | None
    indexer_head_dim: int | None
    indexer_budget: int | None
    indexer_compress_ratio: int | None

    @classmethod
    def from_compact(cls, c: Mapping[str, Any]) -> Qwen4ExpConfig:
        archs = c.get("architectures") or []
        if not archs or archs[0] != ARCHITECTURE:
            raise Qwen4ExpConfigError(f"text config architectures {archs} is not {ARCHITECTURE}")
        where = f"{ARCHITECTURE} text config"
        i = lambda k, minimum=1: _int(c, k, where, minimum=minimum)  # noqa: E731
        rope = _rope(c, where)
        qsa = {k: c.get(k) for k in _QSA}
        given = [k for k, v in qsa.items() if v is not None]
        if given and len(given) != len(_QSA):
            raise Qwen4ExpConfigError(f"{where}: the QSA fields are all-or-nothing; missing "
                                      f"{[k for k in _QSA if k not in given]}")
        for k in given:
            i(k)
        layer_types = tuple(c.get("layer_types") or ())
        eos = c.get("eos_token_id")
        cfg = cls(
            vocab_size=i("vocab_size"), hidden_size=i("hidden_size"), num_layers=i("num_hidden_layers"),
            num_heads=i("num_attention_heads"), num_kv_heads=i("num_key_value_heads"), head_dim=i("head_dim"),
            conv_kernel=i("linear_conv_kernel_dim"), linear_key_head_dim=i("linear_key_head_dim"),
            linear_value_head_dim=i("linear_value_head_dim"), linear_num_key_heads=i("linear_num_key_heads"),
            linear_num_value_heads=i("linear_num_value_heads"), num_experts=i("num_experts"),
            num_experts_per_tok=i("num_experts_per_tok"), moe_intermediate_size=i("moe_intermediate_size"),
            shared_expert_intermediate_size=i("shared_expert_intermediate_size"),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), max_position_embeddings=i("max_position_embeddings"),
            rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
            mrope_section=None if rope["mrope_section"] is None else tuple(rope["mrope_section"]),
            layer_types=layer_types, tie_word_embeddings=_tie(c, where),
            output_gate_type=str(c.get("output_gate_type", "silu")), hc_count=i("hc_count"),
            hc_lowrank=i("hc_lowrank"), ple_layer_ids=tuple(c.get("ple_layer_ids") or ()),
            ple_embed_dim=i("ple_embed_dim"), ple_conv_kernel=i("ple_conv_kernel_size"), ngram_size=i("ngram_size"),
            heads_per_ngram=i("heads_per_ngram"), ngram_vocab_size_base=i("ngram_vocab_size_base"),
            ngram_vocab_divisor=i("make_ngram_vocab_size_divisible_by"), seed=i("seed", 0),
            eos_token_id=None if eos is None else int(eos),
            indexer_heads=qsa["indexer_n_heads"], indexer_head_dim=qsa["indexer_head_dim"],
            indexer_budget=qsa["indexer_budget"], indexer_compress_ratio=qsa["indexer_compress_ratio"])
        if given and qsa["indexer_kv_heads"] != 1:
            raise NotSupportedError(f"{where}: indexer_kv_heads={qsa['indexer_kv_heads']} (Qwen4-Exp QSA has one "
                                    f"indexer key head)")
        cfg._validate(where)
        return cfg

    def _validate(self, where: str) -> None:
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR, INDEXED}:
            raise Qwen4ExpConfigError(f"{where}: layer_types must list {LINEAR!r}/{INDEXED!r} for each of "
                                      f"{self.num_layers} layers")
        if self.output_gate_type not in ("silu", "sigmoid"):
            raise Qwen4ExpConfigError(f"{where}: output_gate_type must be 'silu' or 'sigmoid', got "
                                      f"{self.output_gate_type!r}")
        if self.hc_count < 2:
            raise Qwen4ExpConfigError(f"{where}: hc_count must be > 1, got {self.hc_count}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise Qwen4ExpConfigError(f"{where}: rotary dim head_dim*partial_rotary_factor = {self.rotary_dim} must "
                                      f"be even and in (0, head_dim]")
        if self.attention_layers:
            if self.indexer_heads is None:
                raise Qwen4ExpConfigError(f"{where}: attention layers {list(self.attention_layers)} need the QSA "
                                          f"indexer fields {list(_QSA)}")
            if self.indexer_budget % self.indexer_compress_ratio:
                raise Qwen4ExpConfigError(f"{where}: indexer_budget {self.indexer_budget} is not a multiple of "
                                          f"indexer_compress_ratio {self.indexer_compress_ratio}")
            if self.rotary_dim > self.indexer_head_dim:
                raise Qwen4ExpConfigError(f"{where}: rotary dim {self.rotary_dim} exceeds indexer_head_dim "
                                          f"{self.indexer_head_dim}")
        if self.ple_layer_ids:
            bad = [x for x in self.ple_layer_ids if not 1 <= x <= self.num_layers]
            if bad:
                raise Qwen4ExpConfigError(f"{where}: ple_layer_ids {bad} are not one-based layer ids in "
                                          f"[1, {self.num_layers}]")
            not_linear = [x for x in self.ple_layer_ids if self.layer_types[x - 1] != LINEAR]
            if not_linear:
                raise NotSupportedError(f"{where}: PLE on layers {not_linear}, which are not linear_attention layers")
            if self.ngram_size < 2 or self.ple_embed_dim % self.ngram_heads:
                raise Qwen4ExpConfigError(f"{where}: ple_embed_dim {self.ple_embed_dim} must be a multiple of "
                                          f"(ngram_size - 1) * heads_per_ngram = {self.ngram_heads}, ngram_size >= 2")
            if self.eos_token_id is None or not 0 <= self.eos_token_id < self.vocab_size:
                raise Qwen4ExpConfigError(f"{where}: PLE needs eos_token_id in [0, vocab_size), got "
                                          f"{self.eos_token_id!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads or self.num_heads % self.num_kv_heads:
            raise Qwen4ExpConfigError(f"{where}: value heads must be a multiple of key heads (GDN and attention)")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise Qwen4ExpConfigError(f"{where}: num_experts_per_tok {self.num_experts_per_tok} not in "
                                      f"[1, num_experts={self.num_experts}]")

    # -- derived geometry ------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == INDEXED)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """Zero-based indices of the PLE layers, in order (position = the layer's PLE index)."""
        return tuple(x - 1 for x in self.ple_layer_ids)

    @property
    def hc_width(self) -> int:
        """The residual bank's width: hc_count streams of hidden_size."""
        return self.hc_count * self.hidden_size

    @property
    def ngram_heads(self) -> int:
        """Hash heads of one PLE layer: heads_per_ngram for each order 2..ngram_size."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_head_dim(self) -> int:
        return self.ple_embed_dim // self.ngram_heads

    @property
    def ple_conv_history(self) -> int:
        """Past inputs the PLE's dilated conv reads: (kernel - 1) * dilation, the dilation being ngram_size."""
        return (self.ple_conv_kernel - 1) * self.ngram_size

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def indexer_width(self) -> int:
        """Per-token width of the indexer's cache rows: the raw key (indexer_head_dim), and cos | sin (2R)."""
        return max(self.indexer_head_dim, 2 * self.rotary_dim)

    @property
    def qwen35(self) -> Qwen35Config:
        """The Qwen3.5-MoE view of the geometry both families share (GDN, gated attention, MoE), for the layers and
        ops this plugin reuses from ninfer_qwen3_5; its ``full_attention`` layers are Qwen4-Exp's indexed ones."""
        return Qwen35Config(
            architecture=MOE, vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            conv_kernel=self.conv_kernel, linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim, linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta,
            partial_rotary_factor=self.partial_rotary_factor, mrope_section=self.mrope_section,
            mrope_interleaved=True, layer_types=tuple(FULL if t == INDEXED else t for t in self.layer_types),
            tie_word_embeddings=self.tie_word_embeddings, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size)
