"""Logical parameter names and shapes of the vision tower (component ``vision``).

The names are HF's module paths under ``model.visual.`` with ``/`` for ``.`` (what the converter has always
stored), shapes from the compact vision config only (h = hidden, I = intermediate, m = merge unit):

====================================================  ===========================  ==============================
name                                                  shape                        meaning
====================================================  ===========================  ==============================
vision/patch_embed/proj/weight, .../bias              [h, C, Tp, P, P], [h]        Conv3d whose kernel = stride:
                                                                                   a linear over one input row
vision/pos_embed/weight                               [side*side, h]               learned position grid
vision/blocks/{i}/norm1/{weight,bias}, norm2          [h]                          LayerNorms (eps 1e-6)
vision/blocks/{i}/attn/qkv/{weight,bias}              [3h, h], [3h]                rows q | k | v, heads inside
vision/blocks/{i}/attn/proj/{weight,bias}             [h, h], [h]
vision/blocks/{i}/mlp/linear_fc1/{weight,bias}        [I, h], [I]
vision/blocks/{i}/mlp/linear_fc2/{weight,bias}        [h, I], [h]
vision/merger/norm/{weight,bias}                      [h]                          per patch, before merging
vision/merger/linear_fc1/{weight,bias}                [m*h, m*h], [m*h]
vision/merger/linear_fc2/{weight,bias}                [out, m*h], [out]
====================================================  ===========================  ==============================
"""

from __future__ import annotations

from ninfer_qwen3_5.vision.config import VisionConfig

VISION_COMPONENT = "vision"
#: The HF tensor prefix of the tower in a ``*ForConditionalGeneration`` checkpoint.
SOURCE_PREFIX = "model.visual."


def vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every ``vision`` parameter name -> logical shape."""
    h, inter, mh = cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit * cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {
        "vision/patch_embed/proj/weight": (h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                           cfg.patch_size),
        "vision/patch_embed/proj/bias": (h,),
        "vision/pos_embed/weight": (cfg.num_position_embeddings, h),
    }
    for i in range(cfg.depth):
        b = f"vision/blocks/{i}/"
        out.update({b + "norm1/weight": (h,), b + "norm1/bias": (h,), b + "norm2/weight": (h,),
                    b + "norm2/bias": (h,), b + "attn/qkv/weight": (3 * h, h), b + "attn/qkv/bias": (3 * h,),
                    b + "attn/proj/weight": (h, h), b + "attn/proj/bias": (h,),
                    b + "mlp/linear_fc1/weight": (inter, h), b + "mlp/linear_fc1/bias": (inter,),
                    b + "mlp/linear_fc2/weight": (h, inter), b + "mlp/linear_fc2/bias": (h,)})
    out.update({"vision/merger/norm/weight": (h,), "vision/merger/norm/bias": (h,),
                "vision/merger/linear_fc1/weight": (mh, mh), "vision/merger/linear_fc1/bias": (mh,),
                "vision/merger/linear_fc2/weight": (cfg.out_hidden_size, mh),
                "vision/merger/linear_fc2/bias": (cfg.out_hidden_size,)})
    return out


def source_name(name: str) -> str:
    """The HF tensor name of logical parameter ``name`` (``vision/a/b`` -> ``model.visual.a.b``)."""
    return SOURCE_PREFIX + name[len(VISION_COMPONENT) + 1:].replace("/", ".")
