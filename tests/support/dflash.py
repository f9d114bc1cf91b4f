"""Tiny random DFlash / DFlash2 drafters written in the z-lab Hugging Face format (``config.json`` + one safetensors
file), for the converter's ``--draft`` and the drafter tests.

The format, per the published checkpoints: a Qwen3-style config with ``architectures`` ``DFlashDraftModel`` (first
generation: ``block_size`` at the top level) or ``DFlash2DraftModel`` (``block_size`` and the conv / selector fields
in ``dflash_config``), ``dflash_config.target_layer_ids`` and ``dflash_config.mask_token_id``; tensors ``fc``,
``hidden_norm``, ``norm``, ``layers.{i}.*`` (Qwen3 attention with q/k norms, SwiGLU MLP, two RMSNorms) and, for
DFlash2, ``layers.{i}.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}`` and
``candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}``.

Weights are drawn for O(1) activations: matrices N(0, 1/fan_in), RMSNorm weights U(0.5, 1.5), the conv's static
kernel near the identity tap (offset 0 ~ 1, the others ~ 0.1), codebooks N(0, 1/rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def drafter_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors of a drafter described by its HF ``cfg`` (as :func:`write_dflash_drafter` writes it)."""
    g = torch.Generator().manual_seed(seed)
    dc = cfg["dflash_config"]
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]  # noqa: E741
    Nq, Nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(dc["target_layer_ids"])

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    def norm(size: int) -> torch.Tensor:
        return torch.empty(size).uniform_(0.5, 1.5, generator=g)

    t = {"fc.weight": mat(H, n * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(L):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_proj.weight": mat(Nq * D, H), p + "self_attn.k_proj.weight": mat(Nkv * D, H),
                  p + "self_attn.v_proj.weight": mat(Nkv * D, H), p + "self_attn.o_proj.weight": mat(H, Nq * D),
                  p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
                  p + "mlp.gate_proj.weight": mat(I, H), p + "mlp.up_proj.weight": mat(I, H),
                  p + "mlp.down_proj.weight": mat(H, I)})
        if cfg["architectures"][0] == "DFlash2DraftModel":
            K, groups = dc["conv_kernel_size"], H // dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                base = 0.1 * torch.randn(2, K, H, generator=g)
                base[:, 0] += 1.0
                t[f"{p}{conv}.base_kernel"] = base
                t[f"{p}{conv}.kernel_projection.weight"] = 0.3 * mat(2 * K * groups, H)
    if cfg["architectures"][0] == "DFlash2DraftModel":
        V, r = cfg["vocab_size"], dc["selector_rank"]
        t["candidate_selector.predecessor_codebook"] = torch.randn(V, r, generator=g) / r ** 0.5
        t["candidate_selector.successor_codebook"] = torch.randn(V, r, generator=g) / r ** 0.5
        t["candidate_selector.hidden_projection.weight"] = mat(r, H)
    return t


def drafter_config(*, generation: int, hidden_size: int, vocab_size: int, num_target_layers: int,
                   target_layer_ids: list[int], block_size: int, mask_token_id: int, layers: int = 2,
                   heads: int = 4, kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96,
                   sliding_window: int | None = None, is_causal: bool | None = None, conv_kernel: int = 2,
                   conv_group: int = 16, selector_rank: int = 8, selector_top_k: int = 4,
                   rope_theta: float = 10000.0) -> dict:
    """A z-lab ``config.json`` (module docstring). ``sliding_window``: every layer a ``sliding_attention`` layer
    of that window (None: full attention)."""
    dc: dict = {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id}
    cfg: dict = {
        "architectures": ["DFlash2DraftModel" if generation == 2 else "DFlashDraftModel"], "model_type": "qwen3",
        "attention_bias": False, "hidden_act": "silu", "hidden_size": hidden_size, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "max_position_embeddings": 4096,
        "num_target_layers": num_target_layers, "tie_word_embeddings": False, "dflash_config": dc,
        "layer_types": ["sliding_attention" if sliding_window else "full_attention"] * layers,
        "sliding_window": sliding_window, "use_sliding_window": bool(sliding_window),
    }
    if is_causal is None and generation == 2:
        is_causal = False   # what the published DFlash2 configs say
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    if generation == 2:
        cfg["rope_parameters"] = {"rope_theta": rope_theta, "rope_type": "default"}
        dc.update(block_size=block_size, conv_kernel_size=conv_kernel, conv_group_size=conv_group,
                  selector_rank=selector_rank, selector_top_k=selector_top_k)
    else:
        cfg["rope_theta"] = rope_theta
        cfg["block_size"] = block_size
    return cfg


def write_dflash_drafter(folder: Path, *, seed: int = 0, tensors: dict[str, torch.Tensor] | None = None,
                         dtype: torch.dtype = torch.float32, **config) -> Path:
    """Write a random drafter (``config`` as :func:`drafter_config` takes it) into ``folder``; ``tensors``
    replaces the drawn ones (e.g. a test's edited set). Returns ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter_config(**config)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    t = drafter_tensors(cfg, seed) if tensors is None else tensors
    save_file({k: v.to(dtype).contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    return folder
