"""Converting a z-lab DFlash / DFlash2 drafter folder into the target artifact's ``dflash`` component.

:func:`plan_dflash_draft` is the Qwen3.5 source mapping's ``plan_draft`` (``ninfer-convert TARGET OUT --draft
DRAFT_DIR``, :mod:`ninfer.conversion.draft`): the drafter's config becomes the compact ``dflash`` config
(:func:`~ninfer_qwen3_5.dflash.config.compact_dflash_config`), checked against the target (hidden size,
vocabulary, target layer ids); every tensor is imported value-preserving under the names of
:mod:`ninfer_qwen3_5.dflash.parameters` (``gate_proj`` and ``up_proj`` rows into one ``mlp/gate_up`` object); the
text config gains a copy of the drafter config under ``"dflash"``.

Invariants: every draft tensor is consumed exactly once (a tensor the drafter does not have is an error naming
it), each one's shape is checked against the config, and no drafter parameter has a use (the quantization
recipes leave the drafter as stored). Tensor names may carry a ``model.`` prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.artifact.source_mapping import (
    BindingPlan,
    ComponentPlan,
    ConversionPlan,
    ObjectPlan,
    SourceTensor,
)
from ninfer.conversion.draft import DraftPlan

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.dflash.config import (
    COMPONENT,
    TEXT_KEY,
    DFlashConfig,
    DFlashConfigError,
    compact_dflash_config,
)
from ninfer_qwen3_5.dflash.parameters import dflash_shapes

# Parameter suffix (under dflash/layers/{i}/) -> the z-lab tensor under layers.{i}.
_LAYER_SOURCES = {
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "attention/query": "self_attn.q_proj.weight", "attention/key": "self_attn.k_proj.weight",
    "attention/value": "self_attn.v_proj.weight", "attention/out": "self_attn.o_proj.weight",
    "attention/q_norm": "self_attn.q_norm.weight", "attention/k_norm": "self_attn.k_norm.weight",
    "mlp/down": "mlp.down_proj.weight",
    "attention_conv/base": "attention_conv.base_kernel",
    "attention_conv/projection": "attention_conv.kernel_projection.weight",
    "mlp_conv/base": "mlp_conv.base_kernel", "mlp_conv/projection": "mlp_conv.kernel_projection.weight",
}
_TOP_SOURCES = {"fc": "fc.weight", "hidden_norm": "hidden_norm.weight", "norm": "norm.weight",
                "selector/predecessor": "candidate_selector.predecessor_codebook",
                "selector/successor": "candidate_selector.successor_codebook",
                "selector/hidden": "candidate_selector.hidden_projection.weight"}


def _prefix(tensors: Mapping[str, SourceTensor]) -> str:
    for prefix in ("", "model."):
        if f"{prefix}fc.weight" in tensors:
            return prefix
    raise DFlashConfigError("the drafter checkpoint has no fc.weight (nor model.fc.weight): not a DFlash drafter")


def _target_text(target: ConversionPlan) -> Mapping[str, Any]:
    for c in target.components:
        if c.id == "text":
            return c.config
    raise DFlashConfigError("the target plan has no text component")


def plan_dflash_draft(config: Mapping[str, Any], tensors: Mapping[str, SourceTensor],
                      target: ConversionPlan) -> DraftPlan:
    """The :class:`~ninfer.conversion.draft.DraftPlan` of a z-lab drafter for a Qwen3.5 target (module
    docstring); a drafter that does not fit the target is a :class:`DFlashConfigError` naming the mismatch."""
    text = _target_text(target)
    tcfg = Qwen35Config.from_compact(text)
    compact = compact_dflash_config(config)
    cfg = DFlashConfig.from_compact(compact)
    cfg.check_target(tcfg.hidden_size, tcfg.vocab_size, tcfg.num_layers)
    pre = _prefix(tensors)
    consumed: set[str] = set()

    def source(name: str, shape: tuple[int, ...]) -> str:
        t = tensors.get(name)
        if t is None:
            raise DFlashConfigError(f"the {cfg.architecture} checkpoint lacks tensor {name!r}")
        if tuple(t.shape) != tuple(shape):
            raise DFlashConfigError(f"drafter tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                    f"{tuple(shape)}")
        consumed.add(name)
        return name

    objects, bindings = [], []
    for name, shape in dflash_shapes(cfg).items():
        rest = name[len(COMPONENT) + 1:]
        if rest.startswith("layers/"):
            i, suffix = rest[len("layers/"):].split("/", 1)
            src = f"{pre}layers.{i}."
            if suffix == "mlp/gate_up":
                half = (shape[0] // 2, shape[1])
                sources = (source(f"{src}mlp.gate_proj.weight", half), source(f"{src}mlp.up_proj.weight", half))
            else:
                sources = (source(src + _LAYER_SOURCES[suffix], shape),)
        else:
            sources = (source(pre + _TOP_SOURCES[rest], shape),)
        objects.append(ObjectPlan(id=name, component=COMPONENT, sources=sources))
        bindings.append(BindingPlan(name=name, object=name))
    left = sorted(set(tensors) - consumed)
    if left:
        shown = ", ".join(left[:8]) + (f" (+{len(left) - 8} more)" if len(left) > 8 else "")
        raise DFlashConfigError(f"tensors that are not part of a {cfg.architecture} drafter: {shown}")
    plan = ConversionPlan(components=(ComponentPlan(id=COMPONENT, config=compact, target="text"),),
                          objects=tuple(objects), bindings=tuple(bindings))
    return DraftPlan(plan=plan, target_configs={"text": {**text, TEXT_KEY: compact}})
