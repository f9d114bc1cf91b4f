"""The source mapping: a ``LlamaForCausalLM`` checkpoint's tensors -> artifact objects and bindings.

Each object is the dim-0 concatenation of its source tensors, bound whole under its logical name
(:mod:`.parameters`). Projections that read the same input are stored as one object, so the model runs
them as one GEMM: ``q_proj | k_proj | v_proj`` as ``attention/qkv``, ``gate_proj | up_proj`` as
``mlp/gate_up``. Tied embeddings: one object bound twice. Every source tensor is consumed or ignored with a
reason; the stacked shape of every object is checked against the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.artifact.source_mapping import (
    BindingPlan,
    ComponentPlan,
    ConversionPlan,
    ObjectPlan,
    SourceTensor,
)
from ninfer.conversion.errors import SourceError

from ninfer_llama_mini.config import SOURCE_ARCHITECTURES, LlamaMiniConfig, compact_config
from ninfer_llama_mini.parameters import layer_prefix, text_shapes


@dataclass(frozen=True)
class LlamaMiniSourceMapping:
    name: str = "llama_mini"
    source_architectures: tuple[str, ...] = SOURCE_ARCHITECTURES

    def plan(self, config: Mapping[str, Any], tensors: Mapping[str, SourceTensor]) -> ConversionPlan:
        compact = compact_config(config)
        cfg = LlamaMiniConfig.from_compact(compact)
        shapes = text_shapes(cfg)
        objects: list[ObjectPlan] = []
        bindings: list[BindingPlan] = []
        ignored: dict[str, str] = {}

        def store(name: str, *sources: str) -> None:
            missing = [s for s in sources if s not in tensors]
            if missing:
                raise SourceError(f"the checkpoint has no tensor {missing[0]!r} (needed for {name})")
            first = tensors[sources[0]].shape
            stacked = (sum(tensors[s].shape[0] for s in sources), *first[1:])
            if stacked != shapes[name]:
                raise SourceError(f"{', '.join(sources)} stack to {stacked}; the config implies {shapes[name]} "
                                  f"for {name}")
            objects.append(ObjectPlan(id=name, component="text", sources=sources))
            bindings.append(BindingPlan(name=name, object=name))

        store("text/embed", "model.embed_tokens.weight")
        store("text/norm", "model.norm.weight")
        if cfg.tie_word_embeddings:
            bindings.append(BindingPlan(name="text/lm_head", object="text/embed"))
            if "lm_head.weight" in tensors:
                ignored["lm_head.weight"] = "tie_word_embeddings: the head is the embedding"
        else:
            store("text/lm_head", "lm_head.weight")
        for i in range(cfg.num_layers):
            src, p = f"model.layers.{i}.", layer_prefix(i)
            store(f"{p}/input_norm", src + "input_layernorm.weight")
            store(f"{p}/attention/qkv", *(f"{src}self_attn.{x}_proj.weight" for x in "qkv"))
            store(f"{p}/attention/out", src + "self_attn.o_proj.weight")
            store(f"{p}/post_norm", src + "post_attention_layernorm.weight")
            store(f"{p}/mlp/gate_up", src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight")
            store(f"{p}/mlp/down", src + "mlp.down_proj.weight")
        consumed = {s for o in objects for s in o.sources} | set(ignored)
        left = sorted(set(tensors) - consumed)
        if left:
            raise SourceError(f"tensors that are not part of a LlamaForCausalLM: {', '.join(left[:8])}")
        return ConversionPlan(components=(ComponentPlan(id="text", config=compact),), objects=tuple(objects),
                              bindings=tuple(bindings), ignored=ignored)
