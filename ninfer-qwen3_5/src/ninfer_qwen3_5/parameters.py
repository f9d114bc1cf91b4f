"""Logical parameter names and shapes of Qwen3.5 (the artifact binding names).

Scheme: ``<component>/<path>``; a decoder layer is ``text/layers/{i}``:

==============================  ======================  ===========================================
name (under a layer)            shape                   meaning
==============================  ======================  ===========================================
input_norm, post_norm           [H]                     zero-centred RMSNorm weights (1 + w)
gdn/qkv                         [2*Hk*Dk + Hv*Dv, H]    flat [q | k | v] rows (not head-interleaved)
gdn/z                           [Hv*Dv, H]              output-gate projection
gdn/b, gdn/a                    [Hv, H]                 beta and decay-rate projections
gdn/conv                        [C, K]                  depthwise causal conv over the qkv channels
gdn/dt_bias, gdn/A_log          [Hv]
gdn/norm                        [Dv]                    gated RMSNorm weight (plain w)
gdn/out                         [H, Hv*Dv]
attention/query, attention/gate [Nq*D, H]               q_proj de-interleaved per head
attention/key, attention/value  [Nkv*D, H]
attention/q_norm, k_norm        [D]
attention/out                   [H, Nq*D]
mlp/gate_up                     [2I, H]                 gate rows, then up rows (dense layers)
mlp/down                        [H, I]
moe/router                      [E, H]
moe/experts/gate_up             [E, 2Ie, H]             expert bank, gate rows first per expert
moe/experts/down                [E, H, Ie]
moe/shared/gate_up, shared/down [2Is, H], [H, Is]       shared expert
moe/shared/gate                 [1, H]                  sigmoid gate of the shared expert
==============================  ======================  ===========================================

Plus ``text/embed`` [V, H], ``text/norm`` [H], ``text/lm_head`` [V, H] (the same object as
``text/embed`` when embeddings are tied). Shapes come from the config only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.contracts.architecture import ParameterSpec
from ninfer.contracts.features import StartupFeatures
from ninfer.errors import NotSupportedError

from ninfer_qwen3_5.config import FULL, Qwen35Config
from ninfer_qwen3_5.vision.config import VisionConfig
from ninfer_qwen3_5.vision.parameters import VISION_COMPONENT, vision_shapes


def layer_prefix(component: str, i: int) -> str:
    return f"{component}/layers/{i}"


def layer_shapes(cfg: Qwen35Config, kind: str) -> dict[str, tuple[int, ...]]:
    """Parameter suffix -> shape for one decoder layer of ``kind`` (``linear_attention`` or
    ``full_attention``); shared by text layers and MTP layers (same geometry and MLP type)."""
    H = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"input_norm": (H,), "post_norm": (H,)}
    if kind == FULL:
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        out.update({"attention/query": (qd, H), "attention/gate": (qd, H), "attention/key": (kd, H),
                    "attention/value": (kd, H), "attention/q_norm": (cfg.head_dim,),
                    "attention/k_norm": (cfg.head_dim,), "attention/out": (H, qd)})
    else:
        Hv = cfg.linear_num_value_heads
        out.update({"gdn/qkv": (cfg.conv_dim, H), "gdn/z": (cfg.value_dim, H), "gdn/b": (Hv, H),
                    "gdn/a": (Hv, H), "gdn/conv": (cfg.conv_dim, cfg.conv_kernel), "gdn/dt_bias": (Hv,),
                    "gdn/A_log": (Hv,), "gdn/norm": (cfg.linear_value_head_dim,), "gdn/out": (H, cfg.value_dim)})
    if cfg.is_moe:
        E, Ie, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out.update({"moe/router": (E, H), "moe/experts/gate_up": (E, 2 * Ie, H), "moe/experts/down": (E, H, Ie),
                    "moe/shared/gate_up": (2 * Is, H), "moe/shared/down": (H, Is), "moe/shared/gate": (1, H)})
    else:
        out.update({"mlp/gate_up": (2 * cfg.intermediate_size, H), "mlp/down": (H, cfg.intermediate_size)})
    return out


def text_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every ``text`` parameter name -> logical shape."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out = {"text/embed": (V, H), "text/norm": (H,), "text/lm_head": (V, H)}
    for i, kind in enumerate(cfg.layer_types):
        for suffix, shape in layer_shapes(cfg, kind).items():
            out[f"{layer_prefix('text', i)}/{suffix}"] = shape
    return out


def mtp_shapes(cfg: Qwen35Config, num_layers: int) -> dict[str, tuple[int, ...]]:
    """The ``mtp`` component's own parameters (it reuses ``text/embed`` and ``text/lm_head``)."""
    H = cfg.hidden_size
    out = {"mtp/fc": (H, 2 * H), "mtp/pre_fc_norm_embedding": (H,), "mtp/pre_fc_norm_hidden": (H,),
           "mtp/norm": (H,)}
    for j in range(num_layers):
        for suffix, shape in layer_shapes(cfg, FULL).items():
            out[f"{layer_prefix('mtp', j)}/{suffix}"] = shape
    return out


#: The artifact component holding the MTP head (converted from the checkpoint's ``mtp.*`` tensors).
MTP_COMPONENT = "mtp"


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
    return [ParameterSpec(name=n, shape=s, component=MTP_COMPONENT) for n, s in shapes.items()]


def vision_parameter_specs(text_config: Mapping[str, Any]) -> list[ParameterSpec]:
    """Every parameter of the ``vision`` component, shapes from the text config's ``vision_config`` (the
    converter copies the tower's compact config there). Refused, saying why, when the artifact has no tower
    the runtime can bind."""
    vision = text_config.get("vision_config")
    if vision is None:
        raise NotSupportedError("this artifact has no vision tower (it was converted from a text-only checkpoint, "
                                "or before ninfer stored the tower's config with the text model: re-convert it); "
                                "image and video input are not available")
    shapes = vision_shapes(VisionConfig.from_compact(vision))
    return [ParameterSpec(name=n, shape=s, component=VISION_COMPONENT) for n, s in shapes.items()]


#: The text layers' routed expert banks, which ``features.host_experts`` places in host memory (docs/memory.md).
HOST_EXPERT_BANKS = ("/moe/experts/gate_up", "/moe/experts/down")


def host_layers_of(num_layers: int, features: StartupFeatures) -> tuple[int, ...]:
    """Of ``num_layers`` MoE layers, those whose routed banks are in host memory: with ``features.host_experts``,
    all but the last ``features.device_expert_layers`` (those keep their banks whole on the device). A count that
    leaves no layer on the host is a NotSupportedError naming the option (Qwen3.5's and Qwen4-Exp's rule)."""
    if not features.host_experts:
        return ()
    if features.device_expert_layers >= num_layers:
        raise NotSupportedError(f"device_expert_layers={features.device_expert_layers} (--device-expert-layers): "
                                f"this model has {num_layers} MoE layers and host experts keep at least one on "
                                f"the host; to keep every layer's experts on the device, start with --no-host-experts")
    return tuple(range(num_layers - features.device_expert_layers))


def host_expert_layers(cfg: Qwen35Config, features: StartupFeatures) -> tuple[int, ...]:
    """The text layers whose routed banks are in host memory (:func:`host_layers_of`; none for a dense model)."""
    return host_layers_of(cfg.num_layers, features) if cfg.is_moe else ()


def host_placed(cfg: Qwen35Config, features: StartupFeatures) -> frozenset[str]:
    """The ``text`` parameters placed in host memory: the host layers' routed banks and, with host experts, the
    embedding table unless the LM head shares it or a DFlash drafter gathers from it on the device. The device
    reads embedding rows from the page-locked table over the bus (a row per token, a few KiB a step), which frees
    the table's device memory for expert layers and cache slots; the LM head reads its whole table every step,
    so it stays."""
    names = {layer_prefix("text", i) + bank for i in host_expert_layers(cfg, features) for bank in HOST_EXPERT_BANKS}
    if names and not cfg.tie_word_embeddings and features.speculative not in ("dflash", "dflash2"):
        names.add("text/embed")
    return frozenset(names)


def parameter_specs(config: Mapping[str, Any], features: StartupFeatures) -> list[ParameterSpec]:
    """The parameters the selected features bind: the ``text`` component, plus the ``mtp`` component's own
    parameters when ``features.speculative == "mtp"`` (an artifact without that component is refused when
    they are bound), the ``dflash`` component's with ``"dflash"`` / ``"dflash2"`` (shapes from the drafter
    config the text config carries; an artifact converted without a drafter is a MissingComponentError), and
    the ``vision`` component's with ``features.vision``. Vision together with a speculative backend is refused
    here until a program supports both. ``features.host_experts`` places the text layers' routed expert banks
    in host memory (a dense model refuses it)."""
    if features.speculative not in (None, "mtp", "dflash", "dflash2"):
        raise NotSupportedError(f"Qwen3.5 speculative backend {features.speculative!r} is not supported")
    if features.vision and features.speculative is not None:
        raise NotSupportedError("Qwen3.5 vision with speculative decoding is not supported yet: start without "
                                "the speculative backend, or without vision")
    cfg = Qwen35Config.from_compact(config)
    if features.host_experts and not cfg.is_moe:
        raise NotSupportedError("host_experts=True (--host-experts): this model is dense, it has no routed experts "
                                "to place in host memory")
    if cfg.is_moe and features.expert_cache_slots > cfg.num_experts:
        raise NotSupportedError(f"expert_cache_slots={features.expert_cache_slots} (--expert-cache-slots): this "
                                f"model's layers have {cfg.num_experts} experts, so at most that many can be cached")
    hosted = host_placed(cfg, features)
    specs = [ParameterSpec(name=n, shape=s, component="text", placement="host" if n in hosted else "device")
             for n, s in text_shapes(cfg).items()]
    if features.speculative == "mtp":
        # The converter copies the head's config keys into the text config; an artifact converted without
        # the head may lack them: its specs still name the ``mtp`` component, which startup then finds missing.
        mtp_config = {"mtp_num_hidden_layers": config.get("mtp_num_hidden_layers") or 1,
                      "mtp_use_dedicated_embeddings": config.get("mtp_use_dedicated_embeddings", False)}
        specs += mtp_parameter_specs(config, mtp_config)
    elif features.speculative in ("dflash", "dflash2"):
        specs += _dflash_specs(config, features.speculative)
    if features.vision:
        specs += vision_parameter_specs(config)
    return specs


def _dflash_specs(config: Mapping[str, Any], backend: str) -> list[ParameterSpec]:
    from ninfer.artifact.errors import MissingComponentError

    from ninfer_qwen3_5.dflash import drafter_for_backend
    from ninfer_qwen3_5.dflash.config import TEXT_KEY
    from ninfer_qwen3_5.dflash.parameters import dflash_parameter_specs

    if config.get(TEXT_KEY) is None:
        raise MissingComponentError(
            f"speculative={backend!r} (--speculative {backend}) needs the artifact component 'dflash', which this "
            f"artifact does not have; convert the target with its drafter: ninfer-convert TARGET OUT --draft DRAFT_DIR")
    return dflash_parameter_specs(drafter_for_backend(config, backend))
