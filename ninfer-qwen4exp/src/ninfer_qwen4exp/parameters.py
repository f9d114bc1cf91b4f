"""Logical parameter names and shapes of Qwen4-Exp (the artifact binding names).

Scheme: ``<component>/<path>``; a decoder layer is ``text/layers/{i}``. n = hc_count, H = hidden_size, nH = n*H,
R = hc_lowrank, E = ple_embed_dim, G = n-gram hash heads, d = indexer_head_dim, h = indexer heads:

==============================  ======================  ===========================================
name (under a layer)            shape                   meaning
==============================  ======================  ===========================================
attn_hc/norm, mlp_hc/norm       [nH]                    per-stream (1 + w) RMSNorm weights
attn_hc/down, mlp_hc/down       [R, nH]                 input-mixer down projection
attn_hc/inject, mlp_hc/inject   [n, nH]                 per-stream injection logits
attn_hc/up, mlp_hc/up           [nH, R]                 input-mixer up projection
gdn/*                           as Qwen3.5              Gated DeltaNet (linear_attention layers)
attention/*                     as Qwen3.5              gated attention (indexed_attention layers), plus:
attention/indexer_q             [h*d, H]                indexer queries
attention/indexer_k             [d, H]                  indexer token key (raw)
attention/indexer_q_norm, _k_   [d]                     (1 + w) RMSNorms of the indexer
moe/*                           as Qwen3.5-MoE          router, expert banks, shared expert
ple/table                       [rows, E/G]             hashed n-gram table (host memory)
ple/key, ple/value              [nH, E], [H, E]
ple/norm_key, _query, _conv     [nH]                    per-stream (1 + w) RMSNorms
ple/conv                        [nH, K]                 dilated depthwise conv (dilation ngram_size)
==============================  ======================  ===========================================

Plus ``text/embed`` [V, H], ``text/lm_head`` [V, H] (the embedding's object when tied) and the final stream
reduction ``text/mixer_hc/{norm, down, up}``. Shapes come from the config only. ``ple/table`` is the one parameter
placed in host memory (``ParameterSpec.placement``): at the real model's size it cannot live on the device, and a
step reads only the rows its tokens hash to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.contracts.architecture import ParameterSpec
from ninfer.contracts.features import StartupFeatures
from ninfer.errors import NotSupportedError
from ninfer_qwen3_5.config import FULL
from ninfer_qwen3_5.parameters import HOST_EXPERT_BANKS, host_layers_of, layer_prefix, vision_parameter_specs
from ninfer_qwen3_5.parameters import layer_shapes as qwen35_layer_shapes

from ninfer_qwen4exp.config import INDEXED, Qwen4ExpConfig
from ninfer_qwen4exp.ple_hash import config_hash

#: Suffix of the one host-resident parameter of a PLE layer.
PLE_TABLE = "ple/table"


def hc_shapes(cfg: Qwen4ExpConfig, inject: bool = True) -> dict[str, tuple[int, ...]]:
    """One hyper-connection module's parameters (the final reduction has no ``inject``)."""
    nh, r = cfg.hc_width, cfg.hc_lowrank
    out = {"norm": (nh,), "down": (r, nh), "up": (nh, r)}
    if inject:
        out["inject"] = (cfg.hc_count, nh)
    return out


def layer_shapes(cfg: Qwen4ExpConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Parameter suffix -> shape for decoder layer ``i``."""
    return decoder_shapes(cfg, cfg.layer_types[i], cfg.ple_layers.index(i) if i in cfg.ple_layers else None)


def decoder_shapes(cfg: Qwen4ExpConfig, kind: str, ple_index: int | None) -> dict[str, tuple[int, ...]]:
    """Parameter suffix -> shape for a decoder layer of ``kind``, with the PLE of PLE layer ``ple_index`` (None:
    none). The MTP layer is one of these (``INDEXED``, no PLE)."""
    shared = qwen35_layer_shapes(cfg.qwen35, FULL if kind == INDEXED else kind)
    out = {k: v for k, v in shared.items() if k not in ("input_norm", "post_norm")}
    for module in ("attn_hc", "mlp_hc"):
        out.update({f"{module}/{k}": v for k, v in hc_shapes(cfg).items()})
    H = cfg.hidden_size
    if kind == INDEXED:
        d = cfg.indexer_head_dim
        out.update({"attention/indexer_q": (cfg.indexer_heads * d, H), "attention/indexer_k": (d, H),
                    "attention/indexer_q_norm": (d,), "attention/indexer_k_norm": (d,)})
    if ple_index is not None:
        nh, e, k = cfg.hc_width, cfg.ple_embed_dim, cfg.ple_conv_kernel
        rows = config_hash(cfg, ple_index).rows
        out.update({PLE_TABLE: (rows, cfg.ple_head_dim), "ple/key": (nh, e), "ple/value": (H, e),
                    "ple/norm_key": (nh,), "ple/norm_query": (nh,), "ple/norm_conv": (nh,), "ple/conv": (nh, k)})
    return out


def text_shapes(cfg: Qwen4ExpConfig) -> dict[str, tuple[int, ...]]:
    """Every ``text`` parameter name -> logical shape."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"text/embed": (V, H), "text/lm_head": (V, H)}
    out.update({f"text/mixer_hc/{k}": v for k, v in hc_shapes(cfg, inject=False).items()})
    for i in range(cfg.num_layers):
        for suffix, shape in layer_shapes(cfg, i).items():
            out[f"{layer_prefix('text', i)}/{suffix}"] = shape
    return out


#: The artifact component holding the MTP head (converted from the checkpoint's ``mtp.*`` tensors).
MTP_COMPONENT = "mtp"


def mtp_num_layers(mtp_config: Mapping[str, Any]) -> int:
    """The MTP layer count of an ``mtp`` component config (or of the compact text config, which carries the same
    keys); only one layer with shared embeddings is supported."""
    n = mtp_config.get("mtp_num_hidden_layers")
    if n != 1:
        raise NotSupportedError(f"Qwen4-Exp MTP with mtp_num_hidden_layers={n!r} is not supported (only 1)")
    if mtp_config.get("mtp_use_dedicated_embeddings", False):
        raise NotSupportedError("Qwen4-Exp MTP with dedicated embeddings is not supported (only shared ones)")
    return 1


def mtp_shapes(cfg: Qwen4ExpConfig) -> dict[str, tuple[int, ...]]:
    """The ``mtp`` component's own parameters (it shares ``text/embed`` and ``text/lm_head``): the input fusion
    ``fc_embedding`` / ``fc_hidden`` [H, H] and their norms (``pre_fc_norm_hidden`` spans the whole bank, [nH]),
    one indexed-attention decoder layer without PLE (``mtp/layers/0/...``, a text layer's suffixes) and the stream
    reduction ``mtp/mixer_hc``. There is no final norm."""
    H = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"mtp/fc_embedding": (H, H), "mtp/fc_hidden": (H, H),
                                       "mtp/pre_fc_norm_embedding": (H,), "mtp/pre_fc_norm_hidden": (cfg.hc_width,)}
    out.update({f"mtp/mixer_hc/{k}": v for k, v in hc_shapes(cfg, inject=False).items()})
    for suffix, shape in decoder_shapes(cfg, INDEXED, None).items():
        out[f"{layer_prefix('mtp', 0)}/{suffix}"] = shape
    return out


def mtp_parameter_specs(text_config: Mapping[str, Any], mtp_config: Mapping[str, Any] | None = None
                        ) -> list[ParameterSpec]:
    """Every parameter of the ``mtp`` component; ``mtp_config`` None: the text config's own ``mtp_*`` keys (a text
    config without them is an artifact converted from a checkpoint without an MTP head: refused by name)."""
    source = text_config if mtp_config is None else mtp_config
    if source.get("mtp_num_hidden_layers") is None:
        raise NotSupportedError("speculative backend 'mtp' needs the artifact's MTP head (the mtp component), and "
                                "this Qwen4-Exp artifact has none: its checkpoint had no mtp.* tensors")
    mtp_num_layers(source)
    cfg = Qwen4ExpConfig.from_compact(text_config)
    return [ParameterSpec(name=n, shape=s, component=MTP_COMPONENT) for n, s in mtp_shapes(cfg).items()]


def is_host_parameter(name: str) -> bool:
    """Always in host memory: the PLE tables (host experts are placed by :func:`parameter_specs` when asked)."""
    return name.endswith("/" + PLE_TABLE)


def host_expert_layers(cfg: Qwen4ExpConfig, features: StartupFeatures) -> tuple[int, ...]:
    """The text layers whose routed banks are in host memory (Qwen3.5's rule, every layer being a MoE layer)."""
    return host_layers_of(cfg.num_layers, features)


def host_expert_names(cfg: Qwen4ExpConfig, features: StartupFeatures) -> frozenset[str]:
    """The text layers' routed expert banks placed in host memory (:func:`host_expert_layers`; the MTP head's stay on
    the device)."""
    return frozenset(layer_prefix("text", i) + bank for i in host_expert_layers(cfg, features)
                     for bank in HOST_EXPERT_BANKS)


def parameter_specs(config: Mapping[str, Any], features: StartupFeatures) -> list[ParameterSpec]:
    """The ``text`` parameters (the PLE tables placed in host memory, and with ``features.host_experts`` the text
    layers' routed expert banks too, but the last ``features.device_expert_layers`` layers'), plus the ``mtp`` component's with ``features.speculative == "mtp"`` (an
    artifact without that component is refused when they are bound), plus the ``vision`` component's (Qwen3.5-MoE's
    tower) with ``features.vision``. Any other speculative backend, and vision together with speculation, are
    refused."""
    if features.vision and features.speculative is not None:
        raise NotSupportedError("Qwen4-Exp vision with speculative decoding is not supported yet: start without "
                                "the speculative backend, or without vision")
    if features.speculative not in (None, "mtp"):
        raise NotSupportedError(f"Qwen4-Exp speculative backend {features.speculative!r} is not supported (mtp)")
    cfg = Qwen4ExpConfig.from_compact(config)
    banks = host_expert_names(cfg, features)

    def placement(name: str) -> str:
        return "host" if is_host_parameter(name) or name in banks else "device"

    specs = [ParameterSpec(name=n, shape=s, component="text", placement=placement(n))
             for n, s in text_shapes(cfg).items()]
    if features.speculative == "mtp":
        specs.extend(mtp_parameter_specs(config))
    if features.vision:
        specs.extend(vision_parameter_specs(config))
    return specs
