"""Parity of a trained drafter folder between the training model (tools/dflash_model.py) and the engine
(``ninfer_qwen3_5.dflash``): proof that the stored weights mean the same thing in both.

The target folder is converted with the drafter (``ninfer.conversion.convert(..., draft=DIR)``, what
``ninfer-convert TARGET OUT --draft DIR`` runs) and loaded back as the engine loads it (fp32, the torch
reference ops). For a few anchors in one token sequence, the block logits of the engine's ``DFlashDrafter``
(context K/V written from the features, then ``block_hidden`` over the paged KV cache) are compared with the
training model's for the same context and anchor, twice:

- ``drafter``: both fed the same target features (transformers' hidden states): the drafter math alone;
- ``engine``: the engine fed its own target forward (``Qwen35Model.forward(..., aux_layers=...)``), the training
  model transformers' features: the whole path a served request takes.

DFlash2 also compares the selector: the engine's hidden projection and the greedy drafted paths.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from dflash_eval import draft_paths
from dflash_model import DraftModel

CPU, F32 = torch.device("cpu"), torch.float32


def _engine(target_dir: Path, draft_dir: Path, artifact: Path):
    from ninfer.conversion import convert
    from ninfer_qwen3_5.dflash_reference import load_reference

    return load_reference(convert(target_dir, artifact, progress=False, draft=draft_dir).paths[0])


def _engine_logits(cfg, ops, model, drafter, tokens: list[int], anchors: list[int], hf_feats: torch.Tensor | None):
    """Engine block logits ``[N, B - 1, V]`` and hidden ``[N, B - 1, H]``: one sequence per anchor, its context
    ``tokens[:s]`` prefilled (features from our target, or ``hf_feats[:s]`` when given)."""
    from ninfer.storage.kv_pool import PagedKVCache
    from ninfer.storage.state_image import StateImageStorage
    from ninfer_qwen3_5.dflash.drafter import BlockRow
    from ninfer_qwen3_5.mtp import mtp_step_context
    from ninfer_qwen3_5.state import state_layout

    d = drafter.cfg
    own = {layer.kv_layer: (d.num_kv_heads, d.head_dim) for layer in drafter.layers}
    kv = PagedKVCache((*cfg.attention_layers, *own), num_pages=4 * (len(tokens) // 4 + 8), page_size=4,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=F32, device=CPU, geometry=own)
    states = StateImageStorage(state_layout(cfg, F32), len(anchors), CPU)
    rows = []
    for seq, s in enumerate(anchors):
        assert kv.ensure(seq, s + d.block_size, write_from=0)
        ctx = replace(mtp_step_context(kv, chunks=[(seq, 0, s)], device=CPU), chunk_slots=(seq,), states=states)
        _, aux = model.forward(torch.tensor(tokens[:s]), ctx, None, aux_layers=d.target_layer_ids)
        if hf_feats is not None:
            aux = hf_feats[:s]
        drafter.write_context(kv, aux, ctx.positions, ctx.slot_mapping)
        rows.append(BlockRow(seq, s, tokens[s], d.block_size))
    hidden = drafter.block_hidden(kv, rows).view(len(anchors), d.block_size - 1, -1)
    return drafter.logits(hidden), hidden


def check(target, draft_dir: Path, tokens: list[int], anchors: list[int], artifact: Path) -> dict:
    """The parity figures (module docstring) of the drafter in ``draft_dir`` for ``target``
    (a :class:`dflash_target.Target` on the CPU) over ``tokens`` at ``anchors``."""
    model = DraftModel.load(draft_dir, target.embed, target.lm_head).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        feats, _ = target.features(ids)
        hidden = model.block_hidden(feats, ids, torch.tensor([anchors]))[0]
        want = model.logits(hidden)
        cfg, ops, engine_model, drafter = _engine(target.folder, draft_dir, artifact)
        out = {"anchors": anchors, "block_size": model.cfg.block_size, "artifact": artifact.name}
        for name, fed in (("drafter", feats[0]), ("engine", None)):
            got, got_hidden = _engine_logits(cfg, ops, engine_model, drafter, tokens, anchors, fed)
            out[f"{name}_max_abs_logit_error"] = float((got - want).abs().max())
            out[f"{name}_max_abs_hidden_error"] = float((got_hidden - hidden).abs().max())
            out[f"{name}_same_argmax"] = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
        out["max_abs_logit"] = float(want.abs().max())
        if model.cfg.generation == 2:
            anchor_tok = torch.tensor([tokens[s] for s in anchors])
            mine = draft_paths(model, hidden, want, anchor_tok)
            from ninfer_qwen3_5.dflash.propose import select_path

            rows = len(anchors)
            theirs = select_path(got, ops.linear(got_hidden, drafter.selector_hidden), anchor_tok,
                                 drafter.selector_predecessor, drafter.selector_successor, drafter.cfg.selector_top_k,
                                 [0.0] * rows, [0] * rows, [0] * rows)[0]
            out["selector_projection_max_abs_error"] = float(
                (ops.linear(got_hidden, drafter.selector_hidden)
                 - model.candidate_selector.hidden_projection(hidden)).abs().max())
            out["selector_same_paths"] = bool(torch.equal(mine, theirs))
    return out
