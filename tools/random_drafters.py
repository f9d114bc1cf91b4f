"""Random DFlash / DFlash2 drafters of the published size for a target geometry, as z-lab folders.

A drafter is written as the converter's ``--draft`` input (``ninfer-convert TARGET OUT --draft DIR``): ``config.json``
(the training tool's :func:`dflash_model.hf_config`, both generations, parsed by the engine's own
``compact_dflash_config``) and ``model.safetensors`` in bf16 under the z-lab tensor names. Its shape is the
published drafters': ``PUBLISHED_LAYERS`` decoder layers at the target's hidden size, the target's attention heads
(``num_attention_heads``, ``num_key_value_heads``, ``head_dim``) and FFN width, RoPE theta and RMSNorm epsilon;
``target_layer_ids`` spread over the target's layers by the reference rule
(:func:`ninfer_qwen3_5.dflash.config.default_target_layer_ids`: one per drafter layer, from layer 1 to ``L - 3``;
a target of fewer than 5 layers repeats layer 1). The mask token is the vocabulary's last id. DFlash2's conv and
selector fields default to the training tool's (``tools/train_dflash.py``).

Weights give O(1) activations, as ``tests/support/dflash.py`` draws them: matrices N(0, 1/fan_in), RMSNorm
weights U(0.5, 1.5), the conv's static kernel near the identity tap (offset 0 ~ 1, the others ~ 0.1), its
kernel projection N(0, 0.09/fan_in), codebooks N(0, 1/rank). They are drawn on ``device`` (a 9B-shape drafter
is about a billion parameters) and written from host memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_TOOLS = str(Path(__file__).resolve().parent)
if _TOOLS not in sys.path:
    sys.path.insert(0, _TOOLS)   # dflash_model

PUBLISHED_LAYERS = 5
PUBLISHED_BLOCK = 16
GENERATIONS = {"dflash": 1, "dflash2": 2}


def drafter_config(geometry: dict, generation: int, *, layers: int = PUBLISHED_LAYERS,
                   block_size: int = PUBLISHED_BLOCK, conv_kernel: int = 2, conv_group: int = 16,
                   selector_rank: int = 32, selector_top_k: int = 16) -> dict:
    """The z-lab ``config.json`` of a drafter for the target of ``geometry`` (a tools/gpu_bench_shapes.py
    geometry: a transformers text config's fields), per the module docstring."""
    from dflash_model import hf_config
    from ninfer_qwen3_5.dflash.config import default_target_layer_ids

    target_layers = geometry["num_hidden_layers"]
    return hf_config(
        generation=generation, vocab_size=geometry["vocab_size"], hidden_size=geometry["hidden_size"],
        num_target_layers=target_layers, target_layer_ids=default_target_layer_ids(target_layers, layers),
        mask_token_id=geometry["vocab_size"] - 1, block_size=block_size, layers=layers,
        heads=geometry["num_attention_heads"], kv_heads=geometry["num_key_value_heads"],
        head_dim=geometry["head_dim"], intermediate=geometry["intermediate_size"],
        rope_theta=geometry["rope_parameters"]["rope_theta"], rms_norm_eps=geometry["rms_norm_eps"],
        conv_kernel=conv_kernel, conv_group=conv_group, selector_rank=selector_rank, selector_top_k=selector_top_k)


def drafter_tensors(hf: dict, device, seed: int):
    """Random bf16 tensors on ``device`` of the drafter ``hf`` describes, by their z-lab names."""
    import torch
    from ninfer_qwen3_5.dflash.config import DFlashConfig, compact_dflash_config

    cfg = DFlashConfig.from_compact(compact_dflash_config(hf))
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    qd, kd = cfg.num_heads * D, cfg.num_kv_heads * D

    def normal(shape, std):
        return torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0.0, std, generator=g)

    def mat(rows: int, cols: int, gain: float = 1.0):
        return normal((rows, cols), gain / cols ** 0.5)

    def norm(size: int):
        return torch.empty(size, device=device, dtype=torch.bfloat16).uniform_(0.5, 1.5, generator=g)

    t = {"fc.weight": mat(H, len(cfg.target_layer_ids) * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_proj.weight": mat(qd, H), p + "self_attn.k_proj.weight": mat(kd, H),
                  p + "self_attn.v_proj.weight": mat(kd, H), p + "self_attn.o_proj.weight": mat(H, qd),
                  p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
                  p + "mlp.gate_proj.weight": mat(I, H), p + "mlp.up_proj.weight": mat(I, H),
                  p + "mlp.down_proj.weight": mat(H, I)})
        if cfg.generation == 2:
            k = cfg.conv_kernel_size
            for conv in ("attention_conv", "mlp_conv"):
                base = normal((2, k, H), 0.1)
                base[:, 0] += 1.0
                t[f"{p}{conv}.base_kernel"] = base
                t[f"{p}{conv}.kernel_projection.weight"] = mat(2 * k * cfg.conv_groups, H, 0.3)
    if cfg.generation == 2:
        r = cfg.selector_rank
        t["candidate_selector.predecessor_codebook"] = normal((cfg.vocab_size, r), r ** -0.5)
        t["candidate_selector.successor_codebook"] = normal((cfg.vocab_size, r), r ** -0.5)
        t["candidate_selector.hidden_projection.weight"] = mat(r, H)
    return t


def write_random_drafter(folder: Path, geometry: dict, backend: str, device, seed: int = 2, **config) -> dict:
    """Write a random drafter for ``backend`` (``dflash`` / ``dflash2``) and the target of ``geometry`` into
    ``folder`` (module docstring; ``config``: :func:`drafter_config`'s keywords). Returns what it is: the
    architecture, layers, block size, target layer ids, parameters and bytes."""
    from safetensors.torch import save_file

    hf = drafter_config(geometry, GENERATIONS[backend], **config)
    tensors = drafter_tensors(hf, device, seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    host = {}
    for name in list(tensors):
        host[name] = tensors.pop(name).cpu().contiguous()   # one tensor at a time on both sides
    save_file(host, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dc = hf["dflash_config"]
    return {"architecture": hf["architectures"][0], "layers": hf["num_hidden_layers"],
            "block_size": dc["block_size"], "target_layer_ids": dc["target_layer_ids"],
            "mask_token_id": dc["mask_token_id"], "parameters": sum(t.numel() for t in host.values()),
            "bytes": sum(t.numel() * t.element_size() for t in host.values()),
            **({k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
               if backend == "dflash2" else {})}
