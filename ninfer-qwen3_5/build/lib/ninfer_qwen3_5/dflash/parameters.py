"""The ``dflash`` component's parameters: names, shapes, specs.

==================================  ====================  ==============================================
name                                shape                 z-lab source tensor
==================================  ====================  ==============================================
dflash/fc                           [H, n*H]              fc.weight (n = len(target_layer_ids))
dflash/hidden_norm, dflash/norm     [H]                   hidden_norm.weight, norm.weight (plain RMSNorm w)
L/input_norm, L/post_norm           [H]                   layers.i.{input,post_attention}_layernorm.weight
L/attention/query                   [Nq*D, H]             layers.i.self_attn.q_proj.weight
L/attention/key, L/attention/value  [Nkv*D, H]            k_proj, v_proj
L/attention/out                     [H, Nq*D]             o_proj
L/attention/q_norm, k_norm          [D]                   q_norm, k_norm (plain RMSNorm w)
L/mlp/gate_up                       [2I, H]               mlp.gate_proj rows, then mlp.up_proj rows
L/mlp/down                          [H, I]                mlp.down_proj
L/attention_conv/base (DFlash2)     [2, K, H]             layers.i.attention_conv.base_kernel
L/attention_conv/projection         [2*K*G, H]            layers.i.attention_conv.kernel_projection.weight
L/mlp_conv/base, projection         as above              layers.i.mlp_conv.*
dflash/selector/predecessor         [V, r]                candidate_selector.predecessor_codebook
dflash/selector/successor           [V, r]                candidate_selector.successor_codebook
dflash/selector/hidden              [r, H]                candidate_selector.hidden_projection.weight
==================================  ====================  ==============================================

``L`` is ``dflash/layers/{i}``; ``G = H / conv_group_size`` channel groups, ``K = conv_kernel_size``. The drafter
has no embedding or LM head of its own: it reads the target's ``text/embed`` and ``text/lm_head``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.contracts.architecture import ParameterSpec

from ninfer_qwen3_5.dflash.config import COMPONENT, TEXT_KEY, DFlashConfig, DFlashConfigError


def dflash_layer_prefix(i: int) -> str:
    return f"{COMPONENT}/layers/{i}"


def dflash_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every ``dflash`` parameter's shape (module docstring)."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size  # noqa: E741
    qd, kd = cfg.num_heads * D, cfg.num_kv_heads * D
    out: dict[str, tuple[int, ...]] = {
        f"{COMPONENT}/fc": (H, len(cfg.target_layer_ids) * H),
        f"{COMPONENT}/hidden_norm": (H,), f"{COMPONENT}/norm": (H,)}
    for i in range(cfg.num_layers):
        p = dflash_layer_prefix(i)
        out.update({f"{p}/input_norm": (H,), f"{p}/post_norm": (H,), f"{p}/attention/query": (qd, H),
                    f"{p}/attention/key": (kd, H), f"{p}/attention/value": (kd, H), f"{p}/attention/out": (H, qd),
                    f"{p}/attention/q_norm": (D,), f"{p}/attention/k_norm": (D,), f"{p}/mlp/gate_up": (2 * I, H),
                    f"{p}/mlp/down": (H, I)})
        if cfg.generation == 2:
            for conv in ("attention_conv", "mlp_conv"):
                out[f"{p}/{conv}/base"] = (2, cfg.conv_kernel_size, H)
                out[f"{p}/{conv}/projection"] = (2 * cfg.conv_kernel_size * cfg.conv_groups, H)
    if cfg.generation == 2:
        r = cfg.selector_rank
        out.update({f"{COMPONENT}/selector/predecessor": (cfg.vocab_size, r),
                    f"{COMPONENT}/selector/successor": (cfg.vocab_size, r),
                    f"{COMPONENT}/selector/hidden": (r, H)})
    return out


def drafter_config(text_config: Mapping[str, Any]) -> DFlashConfig:
    """The drafter config a text config carries (:data:`~ninfer_qwen3_5.dflash.config.TEXT_KEY`); an artifact
    converted without ``--draft`` has none: a :class:`DFlashConfigError` saying how to add one."""
    c = text_config.get(TEXT_KEY)
    if c is None:
        raise DFlashConfigError("this artifact has no DFlash drafter (its text config names no 'dflash' component); "
                                "convert the target with 'ninfer-convert TARGET OUT --draft DRAFT_DIR'")
    return DFlashConfig.from_compact(c)


def dflash_parameter_specs(cfg: DFlashConfig) -> list[ParameterSpec]:
    """Every parameter of the ``dflash`` component (component ``"dflash"``)."""
    return [ParameterSpec(name=n, shape=s, component=COMPONENT) for n, s in dflash_shapes(cfg).items()]
