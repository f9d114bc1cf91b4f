"""The Qwen4-Exp source mapping: HF checkpoint tensors -> artifact components, objects, bindings, uses.

Components: ``text`` (always), ``vision`` (the ``model.visual.*`` tower of a ``Qwen4ExpForConditionalGeneration``
checkpoint: Qwen3.5-MoE's tower, stored and checked as :mod:`ninfer_qwen3_5.mapping` stores that one, its compact
config also copied into the text config under ``vision_config``) and ``mtp`` (the checkpoint's ``mtp.*`` head: input
fusion, one indexed-attention layer, its stream reduction; :func:`_plan_mtp`). Ignored: the PLE hash buffers
(``layer_multipliers``, ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``: :mod:`~ninfer_qwen4exp.ple_hash` derives them from the config), the n-gram statistics some
checkpoints carry (``hashstats_*``, ``token_lookup``) and the final mixer's unused ``block_inject_weight``.

Fused storage (one parent, read back through logical row-range bindings, so the layer runs one GEMM):
- a hyper-connection's ``input_mix_weight_down`` + ``block_inject_weight`` -> ``{attn,mlp}_hc/mix_in``
  ``[R + n, nH]`` (both read the normed bank);
- GDN ``in_proj_qkv`` + ``in_proj_z`` + ``in_proj_b`` + ``in_proj_a`` -> ``gdn/in_proj`` (as Qwen3.5);
- attention ``q_proj`` (de-interleaved per head into query and gate rows, as Qwen3.5) + ``k_proj`` + ``v_proj`` +
  the indexer's ``index_qk_proj`` -> ``attention/in_proj`` ``[query | key | value | gate | indexer q | indexer k]``;
- PLE ``key_proj`` + ``value_proj`` -> ``ple/kv_proj`` (both read the n-gram embedding);
- the n-gram table's checkpoint shards (``ngram_embedding.shard_{j}``, or one unsharded ``ngram_embedding.weight``)
  are concatenated in shard order into ``ple/table``;
- MoE experts as Qwen3.5-MoE: fused banks, or per-expert tensors concatenated into the same bank layout.

Invariant: every source tensor is consumed by exactly one object or listed in ``ignored``; any other tensor is an
error naming it, and every consumed tensor's shape is checked against the config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.artifact.plan_builder import PlanBuilder
from ninfer.artifact.source_mapping import ComponentPlan, ConversionPlan, SourceRows, SourceTensor, UsePlan
from ninfer.errors import NotSupportedError
from ninfer_qwen3_5.mapping import plan_vision, text_prefix
from ninfer_qwen3_5.parameters import layer_prefix
from ninfer_qwen3_5.vision.parameters import SOURCE_PREFIX as VISION_SOURCE_PREFIX

from ninfer_qwen4exp.config import (
    INDEXED,
    SOURCE_ARCHITECTURES,
    Qwen4ExpConfig,
    Qwen4ExpConfigError,
    compact_text_config,
)
from ninfer_qwen4exp.parameters import (
    MTP_COMPONENT,
    PLE_TABLE,
    layer_shapes,
    mtp_num_layers,
    mtp_shapes,
    text_shapes,
)

_PLE_IGNORED = re.compile(r"ple\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets|"
                          r"hashstats_\w+|token_lookup)$")
_SHARD = re.compile(r"ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")



def _hc(b: PlanBuilder, cfg: Qwen4ExpConfig, src: str, dst: str, inject: bool, comp: str = "text") -> None:
    nh, r, n = cfg.hc_width, cfg.hc_lowrank, cfg.hc_count
    b.one(f"{dst}/norm", comp, f"{src}.hc_norm.weight", (nh,))
    b.one(f"{dst}/up", comp, f"{src}.input_mix_weight_up.weight", (nh, r), use=f"{dst}/up_input")
    if not inject:
        b.one(f"{dst}/down", comp, f"{src}.input_mix_weight_down.weight", (r, nh), use=f"{dst}/input")
        extra = f"{src}.block_inject_weight.weight"
        if extra in b.tensors:
            b.ignored[extra] = "the final stream reduction injects nothing (the weight is unused)"
        return
    mix = b.obj(f"{dst}/mix_in", comp, [(f"{src}.input_mix_weight_down.weight", (r, nh)),
                                          (f"{src}.block_inject_weight.weight", (n, nh))])
    at = b.rows(f"{dst}/down", mix, 0, (r, nh), use=f"{dst}/input")
    b.rows(f"{dst}/inject", mix, at, (n, nh), use=f"{dst}/input")


def _gdn(b: PlanBuilder, cfg: Qwen4ExpConfig, g: str, lp: str) -> None:
    c35, H = cfg.qwen35, cfg.hidden_size
    C, Vd, Hv, K = c35.conv_dim, c35.value_dim, c35.linear_num_value_heads, c35.conv_kernel
    inp, use = f"{lp}/gdn/in_proj", f"{lp}/mixer_input"
    b.obj(inp, "text", [(f"{g}in_proj_qkv.weight", (C, H)), (f"{g}in_proj_z.weight", (Vd, H)),
                        (f"{g}in_proj_b.weight", (Hv, H)), (f"{g}in_proj_a.weight", (Hv, H))])
    at = b.rows(f"{lp}/gdn/qkv", inp, 0, (C, H), use)
    at = b.rows(f"{lp}/gdn/z", inp, at, (Vd, H), use)
    at = b.rows(f"{lp}/gdn/b", inp, at, (Hv, H), use)
    b.rows(f"{lp}/gdn/a", inp, at, (Hv, H), use)
    b.one(f"{lp}/gdn/conv", "text", f"{g}conv1d.weight", (C, K), stored=(C, 1, K))
    b.one(f"{lp}/gdn/dt_bias", "text", f"{g}dt_bias", (Hv,))
    b.one(f"{lp}/gdn/A_log", "text", f"{g}A_log", (Hv,))
    b.one(f"{lp}/gdn/norm", "text", f"{g}norm.weight", (cfg.linear_value_head_dim,))
    b.one(f"{lp}/gdn/out", "text", f"{g}out_proj.weight", (H, Vd), use=f"{lp}/gdn/out_input")


def _attention(b: PlanBuilder, cfg: Qwen4ExpConfig, a: str, lp: str, comp: str = "text") -> None:
    H, D, Nq, Nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qd, kd = Nq * D, Nkv * D
    hd, d = cfg.indexer_heads * cfg.indexer_head_dim, cfg.indexer_head_dim
    q_src, inp, use = f"{a}q_proj.weight", f"{lp}/attention/in_proj", f"{lp}/mixer_input"

    def half(h: int, second: bool) -> tuple[SourceRows, tuple[int, ...]]:
        # q_proj's rows alternate per head: [q_h (D rows) | gate_h (D rows)].
        start = 2 * h * D + (D if second else 0)
        return SourceRows(q_src, start, start + D), (2 * qd, H)

    b.obj(inp, comp, [*(half(h, False) for h in range(Nq)), (f"{a}k_proj.weight", (kd, H)),
                        (f"{a}v_proj.weight", (kd, H)), *(half(h, True) for h in range(Nq)),
                        (f"{a}indexer.index_qk_proj.weight", (hd + d, H))])
    at = b.rows(f"{lp}/attention/query", inp, 0, (qd, H), use)
    at = b.rows(f"{lp}/attention/key", inp, at, (kd, H), use)
    at = b.rows(f"{lp}/attention/value", inp, at, (kd, H), use)
    at = b.rows(f"{lp}/attention/gate", inp, at, (qd, H), use)
    at = b.rows(f"{lp}/attention/indexer_q", inp, at, (hd, H), use)
    b.rows(f"{lp}/attention/indexer_k", inp, at, (d, H), use)
    b.one(f"{lp}/attention/out", comp, f"{a}o_proj.weight", (H, qd), use=f"{lp}/attention/out_input")
    b.one(f"{lp}/attention/q_norm", comp, f"{a}q_norm.weight", (D,))
    b.one(f"{lp}/attention/k_norm", comp, f"{a}k_norm.weight", (D,))
    b.one(f"{lp}/attention/indexer_q_norm", comp, f"{a}indexer.q_layernorm.weight", (d,))
    b.one(f"{lp}/attention/indexer_k_norm", comp, f"{a}indexer.k_layernorm.weight", (d,))


def _moe(b: PlanBuilder, cfg: Qwen4ExpConfig, m: str, lp: str, comp: str = "text") -> None:
    H, E = cfg.hidden_size, cfg.num_experts
    Ie, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    use = f"{lp}/mlp_input"
    b.one(f"{lp}/moe/router", comp, f"{m}gate.weight", (E, H), use=use)
    eg, ed = f"{lp}/moe/experts/gate_up", f"{lp}/moe/experts/down"
    if f"{m}experts.gate_up_proj" in b.tensors:
        b.obj(eg, comp, [(f"{m}experts.gate_up_proj", (E, 2 * Ie, H))])
        b.obj(ed, comp, [(f"{m}experts.down_proj", (E, H, Ie))])
    else:   # per-expert tensors: concatenating their rows gives exactly the bank layout
        b.obj(eg, comp, [s for e in range(E) for s in ((f"{m}experts.{e}.gate_proj.weight", (Ie, H)),
                                                          (f"{m}experts.{e}.up_proj.weight", (Ie, H)))])
        b.obj(ed, comp, [(f"{m}experts.{e}.down_proj.weight", (H, Ie)) for e in range(E)])
    b.bind(eg, eg, (E, 2 * Ie, H), use=use)
    b.bind(ed, ed, (E, H, Ie), use=f"{lp}/moe/experts/down_input")
    sg = f"{lp}/moe/shared/gate_up"
    b.obj(sg, comp, [(f"{m}shared_expert.gate_proj.weight", (Is, H)), (f"{m}shared_expert.up_proj.weight", (Is, H))])
    b.bind(sg, sg, (2 * Is, H), use=use)
    b.one(f"{lp}/moe/shared/down", comp, f"{m}shared_expert.down_proj.weight", (H, Is),
          use=f"{lp}/moe/shared/down_input")
    b.one(f"{lp}/moe/shared/gate", comp, f"{m}shared_expert_gate.weight", (1, H), use=use)


def _ple(b: PlanBuilder, cfg: Qwen4ExpConfig, p: str, lp: str, shapes: Mapping[str, tuple[int, ...]]) -> None:
    nh, H, e, k = cfg.hc_width, cfg.hidden_size, cfg.ple_embed_dim, cfg.ple_conv_kernel
    rows, width = shapes[PLE_TABLE]
    whole = f"{p}ple_embedding.ngram_embedding.weight"
    shards = sorted((int(mt.group(1)), n) for n in b.tensors if n.startswith(p) and (mt := _SHARD.search(n)))
    if whole in b.tensors and shards:
        raise Qwen4ExpConfigError(f"{whole!r} and its shards are both in the checkpoint")
    if shards:
        if [j for j, _ in shards] != list(range(len(shards))):
            raise Qwen4ExpConfigError(f"the n-gram table shards under {p!r} are not numbered 0..{len(shards) - 1}: "
                                      f"{[j for j, _ in shards]}")
        got = sum(b.tensors[n].shape[0] for _, n in shards)
        if got != rows:
            raise Qwen4ExpConfigError(f"the n-gram table shards under {p!r} hold {got} rows; the config implies "
                                      f"{rows}")
        sources = [(n, (b.tensors[n].shape[0], width)) for _, n in shards]
    else:
        sources = [(whole, (rows, width))]
    table = f"{lp}/{PLE_TABLE}"
    b.bind(table, b.obj(table, "text", sources), (rows, width))
    kv = b.obj(f"{lp}/ple/kv_proj", "text", [(f"{p}key_proj.weight", (nh, e)), (f"{p}value_proj.weight", (H, e))])
    at = b.rows(f"{lp}/ple/key", kv, 0, (nh, e), use=f"{lp}/ple/embedding")
    b.rows(f"{lp}/ple/value", kv, at, (H, e), use=f"{lp}/ple/embedding")
    for norm in ("norm_key", "norm_query", "norm_conv"):
        b.one(f"{lp}/ple/{norm}", "text", f"{p}{norm}.weight", (nh,))
    b.one(f"{lp}/ple/conv", "text", f"{p}conv1d.weight", (nh, k), stored=(nh, 1, k))
    for name in b.tensors:
        if name.startswith(p) and _PLE_IGNORED.search(name):
            b.ignored[name] = "PLE hash constants and statistics: derived from the config (ninfer_qwen4exp.ple_hash)"


def _plan_text(b: PlanBuilder, cfg: Qwen4ExpConfig, prefix: str) -> None:
    shapes = text_shapes(cfg)
    b.one("text/embed", "text", f"{prefix}embed_tokens.weight", shapes["text/embed"])
    b.uses.append(UsePlan(parameter="text/embed", input="text/input_ids"))
    if cfg.tie_word_embeddings:
        b.bind("text/lm_head", "text/embed", shapes["text/lm_head"], use="text/final_hidden")
        if "lm_head.weight" in b.tensors:
            b.ignored["lm_head.weight"] = "tie_word_embeddings=true: the head is the embedding"
    else:
        b.one("text/lm_head", "text", "lm_head.weight", shapes["text/lm_head"], use="text/final_hidden")
    _hc(b, cfg, f"{prefix}hyper_connection_mixer", "text/mixer_hc", inject=False)
    for i, kind in enumerate(cfg.layer_types):
        src, lp = f"{prefix}layers.{i}.", layer_prefix("text", i)
        _hc(b, cfg, f"{src}attn_hyper_connection", f"{lp}/attn_hc", inject=True)
        _hc(b, cfg, f"{src}mlp_hyper_connection", f"{lp}/mlp_hc", inject=True)
        if kind == INDEXED:
            _attention(b, cfg, f"{src}self_attn.", lp)
        else:
            _gdn(b, cfg, f"{src}linear_attn.", lp)
        _moe(b, cfg, f"{src}mlp.", lp)
        if i in cfg.ple_layers:
            _ple(b, cfg, f"{src}ple.", lp, layer_shapes(cfg, i))


def _plan_mtp(b: PlanBuilder, cfg: Qwen4ExpConfig, text_cfg: Mapping[str, Any]) -> ComponentPlan:
    """The ``mtp.*`` head as the ``mtp`` component (names and shapes: :func:`~ninfer_qwen4exp.parameters.mtp_shapes`;
    the checkpoint names are inferred from sglang's Qwen4-Exp MTP, docs/architectures/qwen4exp.md)."""
    n = text_cfg.get("mtp_num_hidden_layers")
    if n is None:
        raise Qwen4ExpConfigError("the checkpoint has mtp.* tensors but the config has no mtp_num_hidden_layers")
    try:
        mtp_num_layers(text_cfg)
    except NotSupportedError as e:
        raise Qwen4ExpConfigError(str(e)) from None
    shapes = mtp_shapes(cfg)
    for suffix in ("fc_embedding", "fc_hidden", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        name = f"mtp/{suffix}"
        b.one(name, MTP_COMPONENT, f"mtp.{suffix}.weight", shapes[name])
    _hc(b, cfg, "mtp.hyper_connection_mixer", "mtp/mixer_hc", inject=False, comp=MTP_COMPONENT)
    src, lp = "mtp.layers.0.", layer_prefix("mtp", 0)
    _hc(b, cfg, f"{src}attn_hyper_connection", f"{lp}/attn_hc", inject=True, comp=MTP_COMPONENT)
    _hc(b, cfg, f"{src}mlp_hyper_connection", f"{lp}/mlp_hc", inject=True, comp=MTP_COMPONENT)
    _attention(b, cfg, f"{src}self_attn.", lp, comp=MTP_COMPONENT)
    _moe(b, cfg, f"{src}mlp.", lp, comp=MTP_COMPONENT)
    config = {"architectures": ["Qwen4ExpMTP"], "mtp_num_hidden_layers": 1,
              "mtp_use_dedicated_embeddings": bool(text_cfg.get("mtp_use_dedicated_embeddings", False))}
    return ComponentPlan(id=MTP_COMPONENT, config=config, target="text")


@dataclass(frozen=True)
class Qwen4ExpSourceMapping:
    """Converts ``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration`` checkpoints."""

    name: str = "qwen4exp"
    source_architectures: tuple[str, ...] = tuple(SOURCE_ARCHITECTURES)

    def plan(self, config: Mapping[str, Any], tensors: Mapping[str, SourceTensor]) -> ConversionPlan:
        compact = compact_text_config(config)
        cfg = Qwen4ExpConfig.from_compact(compact)
        b = PlanBuilder(tensors, Qwen4ExpConfigError)
        components = [ComponentPlan(id="text", config=compact)]
        _plan_text(b, cfg, text_prefix(tensors, Qwen4ExpConfigError))
        if any(n.startswith("mtp.") for n in tensors):
            components.append(_plan_mtp(b, cfg, config.get("text_config", config)))
        visual = sorted(n for n in tensors if n.startswith(VISION_SOURCE_PREFIX))
        if visual:
            vision = plan_vision(b, config, visual, cfg.hidden_size, moe=True, error=Qwen4ExpConfigError)
            components.append(vision)
            # parameter_specs, profile and the Program see the text config only: it carries the tower's too.
            components[0] = ComponentPlan(id="text", config={**compact, "vision_config": vision.config})
        return b.finish(components, "a Qwen4-Exp model")
