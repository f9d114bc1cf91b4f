"""The Qwen3.5 source mapping: HF checkpoint tensors -> artifact components, objects, bindings, uses.

Components: ``text`` (always), ``vision`` (the ``model.visual.*`` tower, its own objects, its compact config
from ``vision_config`` and the placeholder token ids, :mod:`ninfer_qwen3_5.vision.config`, also copied into the
text config under ``vision_config``), ``mtp`` (the ``mtp.*`` head, its own objects;
it reuses ``text/embed`` and ``text/lm_head``). Private parameters of optional components are never
in a text object, so loading Text reads none of their bytes.

Fused storage (each a single physical parent read back through logical bindings):
- GDN ``in_proj_qkv`` + ``in_proj_z`` + ``in_proj_b`` + ``in_proj_a`` -> one parent ``gdn/in_proj``
  ``[C + Hv*Dv + 2*Hv, H]``; ``gdn/qkv``, ``gdn/z``, ``gdn/b`` and ``gdn/a`` are its four row ranges (the
  layer runs them as one GEMM; artifacts converted before this layout had two parents, qkv+z and b+a,
  and still load: the layer then runs two GEMMs).
- attention ``q_proj`` + ``k_proj`` + ``v_proj`` -> one parent ``attention/in_proj`` ``[query | key |
  value | gate]`` (``[2*Nq*D + 2*Nkv*D, H]``): q_proj's rows alternate per head ``[q_h (D rows), gate_h
  (D rows)]`` and are de-interleaved into it as row ranges; the four bindings are its row ranges, which
  the layer runs as one GEMM. (Artifacts converted before this layout stored q_proj as is and bound
  query and gate as per-head element ranges; they still load, the layer then runs four GEMMs.)
- dense ``gate_proj`` + ``up_proj`` -> one parent bound whole as ``mlp/gate_up`` (the same layout as an
  expert bank); the shared expert likewise.
- MoE experts stay banks ``[E, 2I, H]`` / ``[E, H, I]``; split per-expert checkpoints
  (``experts.{e}.gate_proj`` ...) are concatenated into the same bank layout.
- tied embeddings: one object bound as ``text/embed`` and ``text/lm_head`` (two Uses).

Invariant: every source tensor is consumed by exactly one object or listed in ``ignored``; any
other tensor is an error naming it, and every consumed tensor's shape is checked against the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.artifact.plan_builder import PlanBuilder
from ninfer.artifact.source_mapping import ComponentPlan, ConversionPlan, SourceRows, SourceTensor

from ninfer_qwen3_5.config import (
    FULL,
    SOURCE_ARCHITECTURES,
    Qwen35Config,
    Qwen35ConfigError,
    compact_text_config,
)
from ninfer_qwen3_5.parameters import layer_prefix, layer_shapes, mtp_shapes, text_shapes
from ninfer_qwen3_5.vision.config import VisionConfig, compact_vision_config
from ninfer_qwen3_5.vision.parameters import SOURCE_PREFIX as VISION_SOURCE_PREFIX
from ninfer_qwen3_5.vision.parameters import source_name as vision_source_name
from ninfer_qwen3_5.vision.parameters import vision_shapes


def _rows(name: str, span: tuple[int, int], shape: tuple[int, ...]) -> tuple[SourceRows, tuple[int, ...]]:
    return SourceRows(name, *span), shape


def _plan_layer(b: PlanBuilder, cfg: Qwen35Config, kind: str, src: str, comp: str, i: int) -> None:
    """One decoder layer: HF module names under ``src`` -> bindings under ``{comp}/layers/{i}``."""
    lp = layer_prefix(comp, i)
    shapes = {k: tuple(v) for k, v in layer_shapes(cfg, kind).items()}
    H = cfg.hidden_size
    mixer_in, mlp_in = f"{lp}/mixer_input", f"{lp}/mlp_input"
    for suffix, hf in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm")):
        b.bind(f"{lp}/{suffix}", b.obj(f"{lp}/{suffix}", comp, [(f"{src}{hf}.weight", shapes[suffix])]),
               shapes[suffix])
    if kind == FULL:
        a = f"{src}self_attn."
        D, Nq, Nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qd, kd = Nq * D, Nkv * D
        # One parent [query | key | value | gate] for the four input projections (the layer runs them as one
        # GEMM, layers/fused.py). HF's q_proj interleaves per head: rows [2hD, 2hD + D) are head h's query,
        # [2hD + D, 2hD + 2D) its gate; they are de-interleaved here, once, as row ranges of q_proj.
        q_src = f"{a}q_proj.weight"
        inp = f"{lp}/attention/in_proj"
        b.obj(inp, comp, [*(_rows(q_src, (2 * h * D, 2 * h * D + D), (2 * qd, H)) for h in range(Nq)),
                          (f"{a}k_proj.weight", (kd, H)), (f"{a}v_proj.weight", (kd, H)),
                          *(_rows(q_src, (2 * h * D + D, 2 * h * D + 2 * D), (2 * qd, H)) for h in range(Nq))])
        b.bind(f"{lp}/attention/query", inp, (qd, H), 0, use=mixer_in)
        b.bind(f"{lp}/attention/key", inp, (kd, H), qd * H, use=mixer_in)
        b.bind(f"{lp}/attention/value", inp, (kd, H), (qd + kd) * H, use=mixer_in)
        b.bind(f"{lp}/attention/gate", inp, (qd, H), (qd + 2 * kd) * H, use=mixer_in)
        for suffix, hf, use in (("out", "o_proj", f"{lp}/attention/out_input"),
                                ("q_norm", "q_norm", None), ("k_norm", "k_norm", None)):
            name = f"{lp}/attention/{suffix}"
            b.bind(name, b.obj(name, comp, [(f"{a}{hf}.weight", shapes[f"attention/{suffix}"])]),
                   shapes[f"attention/{suffix}"], use=use)
    else:
        g = f"{src}linear_attn."
        C, Vd, Hv, K = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads, cfg.conv_kernel
        # One parent for the four input projections: the layer runs them as one GEMM (layers/fused.py).
        inp = f"{lp}/gdn/in_proj"
        b.obj(inp, comp, [(f"{g}in_proj_qkv.weight", (C, H)), (f"{g}in_proj_z.weight", (Vd, H)),
                          (f"{g}in_proj_b.weight", (Hv, H)), (f"{g}in_proj_a.weight", (Hv, H))])
        b.bind(f"{lp}/gdn/qkv", inp, (C, H), 0, use=mixer_in)
        b.bind(f"{lp}/gdn/z", inp, (Vd, H), C * H, use=mixer_in)
        b.bind(f"{lp}/gdn/b", inp, (Hv, H), (C + Vd) * H, use=mixer_in)
        b.bind(f"{lp}/gdn/a", inp, (Hv, H), (C + Vd + Hv) * H, use=mixer_in)
        conv = f"{lp}/gdn/conv"
        b.obj(conv, comp, [(f"{g}conv1d.weight", (C, 1, K))])
        b.bind(conv, conv, (C, K))  # [C, 1, K] read as [C, K]: same elements in C order
        for suffix, hf, use in (("dt_bias", "dt_bias", None), ("A_log", "A_log", None),
                                ("norm", "norm.weight", None), ("out", "out_proj.weight", f"{lp}/gdn/out_input")):
            name = f"{lp}/gdn/{suffix}"
            b.bind(name, b.obj(name, comp, [(f"{g}{hf}", shapes[f"gdn/{suffix}"])]), shapes[f"gdn/{suffix}"],
                   use=use)
    m = f"{src}mlp."
    if not cfg.is_moe:
        I = cfg.intermediate_size  # noqa: E741
        gu = f"{lp}/mlp/gate_up"
        b.obj(gu, comp, [(f"{m}gate_proj.weight", (I, H)), (f"{m}up_proj.weight", (I, H))])
        b.bind(gu, gu, (2 * I, H), use=mlp_in)
        down = f"{lp}/mlp/down"
        b.bind(down, b.obj(down, comp, [(f"{m}down_proj.weight", (H, I))]), (H, I), use=f"{lp}/mlp/down_input")
        return
    E, Ie, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    router = f"{lp}/moe/router"
    b.bind(router, b.obj(router, comp, [(f"{m}gate.weight", (E, H))]), (E, H), use=mlp_in)
    eg, ed = f"{lp}/moe/experts/gate_up", f"{lp}/moe/experts/down"
    if b.has(f"{m}experts.gate_up_proj"):
        b.obj(eg, comp, [(f"{m}experts.gate_up_proj", (E, 2 * Ie, H))])
        b.obj(ed, comp, [(f"{m}experts.down_proj", (E, H, Ie))])
    else:  # per-expert split checkpoints: concatenating rows gives exactly the bank layout
        b.obj(eg, comp, [src for e in range(E) for src in ((f"{m}experts.{e}.gate_proj.weight", (Ie, H)),
                                                             (f"{m}experts.{e}.up_proj.weight", (Ie, H)))])
        b.obj(ed, comp, [(f"{m}experts.{e}.down_proj.weight", (H, Ie)) for e in range(E)])
    b.bind(eg, eg, (E, 2 * Ie, H), use=mlp_in)
    b.bind(ed, ed, (E, H, Ie), use=f"{lp}/moe/experts/down_input")
    sg = f"{lp}/moe/shared/gate_up"
    b.obj(sg, comp, [(f"{m}shared_expert.gate_proj.weight", (Is, H)), (f"{m}shared_expert.up_proj.weight", (Is, H))])
    b.bind(sg, sg, (2 * Is, H), use=mlp_in)
    sd = f"{lp}/moe/shared/down"
    b.bind(sd, b.obj(sd, comp, [(f"{m}shared_expert.down_proj.weight", (H, Is))]), (H, Is),
           use=f"{lp}/moe/shared/down_input")
    gate = f"{lp}/moe/shared/gate"
    b.bind(gate, b.obj(gate, comp, [(f"{m}shared_expert_gate.weight", (1, H))]), (1, H), use=mlp_in)


def text_prefix(tensors: Mapping[str, SourceTensor], error: type[Exception] = Qwen35ConfigError) -> str:
    """The text model's tensor prefix: ``model.language_model.`` (ForConditionalGeneration) or ``model.``."""
    for prefix in ("model.language_model.", "model."):
        if f"{prefix}embed_tokens.weight" in tensors:
            return prefix
    raise error("no embedding tensor (model.language_model.embed_tokens.weight or "
                            "model.embed_tokens.weight) in the checkpoint")


def _plan_text(b: PlanBuilder, cfg: Qwen35Config, prefix: str) -> None:
    shapes = text_shapes(cfg)
    b.obj("text/embed", "text", [(f"{prefix}embed_tokens.weight", shapes["text/embed"])])
    b.bind("text/embed", "text/embed", shapes["text/embed"], use="text/input_ids", policy=None)
    b.bind("text/norm", b.obj("text/norm", "text", [(f"{prefix}norm.weight", shapes["text/norm"])]),
           shapes["text/norm"])
    if cfg.tie_word_embeddings:
        b.bind("text/lm_head", "text/embed", shapes["text/lm_head"], use="text/final_hidden")
        if b.has("lm_head.weight"):
            b.ignored["lm_head.weight"] = "tie_word_embeddings=true: the head is the embedding (HF ties it)"
    else:
        b.bind("text/lm_head", b.obj("text/lm_head", "text", [("lm_head.weight", shapes["text/lm_head"])]),
               shapes["text/lm_head"], use="text/final_hidden")
    for i, kind in enumerate(cfg.layer_types):
        _plan_layer(b, cfg, kind, f"{prefix}layers.{i}.", "text", i)


def _plan_mtp(b: PlanBuilder, cfg: Qwen35Config, text_cfg: Mapping[str, Any]) -> ComponentPlan:
    n = text_cfg.get("mtp_num_hidden_layers")
    if not n:
        raise Qwen35ConfigError("the checkpoint has mtp.* tensors but the config has no mtp_num_hidden_layers")
    shapes = mtp_shapes(cfg, int(n))
    for suffix in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        name = f"mtp/{suffix}"
        b.bind(name, b.obj(name, "mtp", [(f"mtp.{suffix}.weight", shapes[name])]), shapes[name],
               use="mtp/fc_input" if suffix == "fc" else None)
    for j in range(int(n)):
        _plan_layer(b, cfg, FULL, f"mtp.layers.{j}.", "mtp", j)
    arch = "Qwen3_5MoeMTP" if cfg.is_moe else "Qwen3_5MTP"
    config = {"architectures": [arch], "mtp_num_hidden_layers": int(n),
              "mtp_use_dedicated_embeddings": bool(text_cfg.get("mtp_use_dedicated_embeddings", False))}
    return ComponentPlan(id="mtp", config=config, target="text")


def plan_vision(b: PlanBuilder, hf: Mapping[str, Any], names: list[str], text_hidden: int, moe: bool,
                error: type[Exception] = Qwen35ConfigError) -> ComponentPlan:
    """The tower (Qwen3.5's or Qwen3.5-MoE's, by ``moe``; Qwen4-Exp's is the latter): every ``model.visual.*``
    tensor in its own ``vision`` object, bound whole under its HF path (:mod:`ninfer_qwen3_5.vision.parameters`);
    the set of tensors and their shapes must be exactly what the vision config implies, whose output width must
    be ``text_hidden``. Config errors are ``error``."""
    if hf.get("vision_config") is None:
        raise error("the checkpoint has model.visual.* tensors but the config has no vision_config")
    config = compact_vision_config(hf, text_hidden, moe)
    shapes = vision_shapes(VisionConfig.from_compact(config))
    expected = {vision_source_name(n): n for n in shapes}
    unknown = sorted(set(names) - set(expected))
    if unknown:
        raise error(f"vision tensors not part of a Qwen3.5 tower: {', '.join(unknown[:8])}")
    for src, name in expected.items():
        b.bind(name, b.obj(name, "vision", [(src, shapes[name])]), shapes[name])
    return ComponentPlan(id="vision", config=config, target="text")


@dataclass(frozen=True)
class Qwen35SourceMapping:
    """Converts ``Qwen3_5(Moe)ForCausalLM`` and ``Qwen3_5(Moe)ForConditionalGeneration`` checkpoints."""

    name: str = "qwen3_5"
    source_architectures: tuple[str, ...] = tuple(SOURCE_ARCHITECTURES)

    def plan(self, config: Mapping[str, Any], tensors: Mapping[str, SourceTensor]) -> ConversionPlan:
        compact = compact_text_config(config)
        cfg = Qwen35Config.from_compact(compact)
        nested = SOURCE_ARCHITECTURES[config["architectures"][0]][1]
        text_cfg = config["text_config"] if nested else config
        b = PlanBuilder(tensors, Qwen35ConfigError)
        components = [ComponentPlan(id="text", config=compact)]
        _plan_text(b, cfg, text_prefix(tensors))
        if any(n.startswith("mtp.") for n in tensors):
            components.append(_plan_mtp(b, cfg, text_cfg))
        visual = sorted(n for n in tensors if n.startswith(VISION_SOURCE_PREFIX))
        if visual:
            vision = plan_vision(b, config, visual, cfg.hidden_size, cfg.is_moe)
            components.append(vision)
            # parameter_specs, profile and the Program see the text config only: it carries the tower's too.
            components[0] = ComponentPlan(id="text", config={**compact, "vision_config": vision.config})
        return b.finish(components, "a Qwen3.5 model")

    def plan_draft(self, config: Mapping[str, Any], tensors: Mapping[str, SourceTensor], target: ConversionPlan):
        """A separately published drafter for this target (``ninfer-convert SRC OUT --draft DIR``): a z-lab DFlash
        or DFlash2 folder becomes the ``dflash`` component (:mod:`ninfer_qwen3_5.dflash.mapping`)."""
        from ninfer_qwen3_5.dflash.mapping import plan_dflash_draft

        return plan_dflash_draft(config, tensors, target)

