"""A small synthetic architecture plugin for the converter tests (``SynthForCausalLM``).

It maps a Llama-like naming scheme onto components, fused objects and bindings, the way a real
architecture plugin does, so the converter can be tested without any real checkpoint:

- ``model.layers.N.self_attn.{q,k,v}_proj.weight`` -> one fused parent ``text/layers/N/attention/qkv``
  with row-range bindings ``.../query``, ``.../key``, ``.../value``;
- ``model.layers.N.mlp.{gate,up}_proj.weight`` -> fused ``.../mlp/gate_up``; ``down_proj`` alone;
- norms take the format ``config["synth_norm_format"]`` (None keeps the dtype);
- ``visual.*`` -> component ``vision``, ``mtp.*`` -> component ``mtp`` (both target ``text``);
- ``*.inv_freq`` is ignored; any other name is left unmapped (the converter must reject it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.artifact.source_mapping import (
    BindingPlan,
    ComponentPlan,
    ConversionPlan,
    ObjectPlan,
    Part,
    SourceTensor,
    UsePlan,
)
from ninfer.plugins import hookimpl

ARCH = "SynthForCausalLM"
# fused object suffix -> (source name template inside a layer, members, logical names in row order)
_FUSED = {
    "attention/qkv": ("self_attn.{}_proj.weight", ("q", "k", "v"),
                      ("attention/query", "attention/key", "attention/value")),
    "mlp/gate_up": ("mlp.{}_proj.weight", ("gate", "up"), ("mlp/gate", "mlp/up")),
}
_SINGLE = {"mlp.down_proj.weight": "mlp/down", "input_layernorm.weight": "input_norm"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class SynthMapping:
    name: str = "synth-mapping"
    source_architectures: tuple[str, ...] = (ARCH,)

    def plan(self, config: Mapping[str, Any], tensors: Mapping[str, SourceTensor]) -> ConversionPlan:
        norm_format = config.get("synth_norm_format")
        objects: list[ObjectPlan] = []
        bindings: list[BindingPlan] = []
        ignored: dict[str, str] = {}
        components = {"text"}

        def single(obj_id: str, component: str, source: str, fmt: str | None = None) -> None:
            objects.append(ObjectPlan(obj_id, component, (source,), fmt))
            bindings.append(BindingPlan(obj_id, object=obj_id))

        fixed = {"model.embed_tokens.weight": "text/embed", "lm_head.weight": "text/lm_head"}
        for name in tensors:
            if name in fixed:
                single(fixed[name], "text", name)
            elif name == "model.norm.weight":
                single("text/final_norm", "text", name, norm_format)
            elif name.endswith(".inv_freq"):
                ignored[name] = "recomputed from rope_theta"
            elif name.startswith("visual."):
                components.add("vision")
                single("vision/" + name[len("visual."):], "vision", name)
            elif name.startswith("mtp."):
                components.add("mtp")
                single("mtp/" + name[len("mtp."):], "mtp", name)

        layers = sorted({int(m.group(1)) for n in tensors if (m := _LAYER.fullmatch(n))})
        for i in layers:
            prefix = f"model.layers.{i}."
            for obj_suffix, (template, members, logical) in _FUSED.items():
                names = [prefix + template.format(m) for m in members]
                if not all(n in tensors for n in names):
                    continue  # an incomplete group stays unmapped: the converter names it
                obj_id = f"text/layers/{i}/{obj_suffix}"
                objects.append(ObjectPlan(obj_id, "text", tuple(names)))
                begin = 0
                for n, lname in zip(names, logical, strict=True):
                    end = begin + math.prod(tensors[n].shape)
                    bindings.append(BindingPlan(f"text/layers/{i}/{lname}", parts=(Part(obj_id, begin, end),)))
                    begin = end
            for source_suffix, suffix in _SINGLE.items():
                if prefix + source_suffix in tensors:
                    fmt = norm_format if suffix.endswith("norm") else None
                    single(f"text/layers/{i}/{suffix}", "text", prefix + source_suffix, fmt)

        plans = [ComponentPlan("text", {"architectures": [ARCH], "hidden_size": config.get("hidden_size"),
                                        "num_hidden_layers": len(layers)})]
        if "vision" in components:
            plans.append(ComponentPlan("vision", {"architectures": ["SynthVision"]}, target="text"))
        if "mtp" in components:
            plans.append(ComponentPlan("mtp", {"architectures": ["SynthMTP"]}, target="text"))
        uses = tuple(UsePlan(b.name, b.name + "#input", "A16Only") for b in bindings)
        return ConversionPlan(tuple(plans), tuple(objects), tuple(bindings), uses, ignored)


@hookimpl
def ninfer_source_mappings() -> list:
    return [SynthMapping()]
