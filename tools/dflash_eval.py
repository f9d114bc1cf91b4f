"""Held-out evaluation of a trained drafter: greedy acceptance against the target, per-position accuracy, and the
target's MTP head on the same anchors.

Method, per held-out stream: non-overlapping windows of ``seq_len`` tokens; in every window, anchors on a fixed
grid ``s = stride, 2 stride, ...`` (``s + B <= seq_len``); the context is the corpus text before ``s`` and the
anchor is the corpus token ``x_s`` (teacher forcing).

- Drafts: the engine's own path functions (``ninfer_qwen3_5.dflash.propose``): DFlash the argmax of each mask
  slot, DFlash2 the candidate selector's greedy path.
- Acceptance (greedy, lossless): the target runs over ``x_0..x_s, d_1..d_{B-1}`` and ``d_i`` is kept while it
  equals the target's own argmax after ``x_s, d_1..d_{i-1}``: accepted length ``a`` = the longest such prefix
  (0..B-1); a speculative step then commits ``a + 1`` tokens. Drafts are compared with the target's greedy
  choices, never with the corpus tokens.
- Per-position accuracy (teacher forced): mask slot ``j``'s argmax against the corpus token ``x_{s+j}`` and
  against the target's greedy token after the corpus prefix ``x_{..s+j-1}``.
- MTP (the default model's head, one draft): at the same anchors, its draft of ``x_{s+1}`` (from ``h_{s-1}`` and
  ``x_s``) against the target's argmax at ``s``: an accepted length of 0 or 1. Longer MTP chains (its own hidden
  state fed back) are not computed here.
"""

from __future__ import annotations

import dflash_corpus
import numpy as np
import torch
from ninfer_qwen3_5.dflash.propose import argmax_path, select_path


def draft_paths(model, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor:
    """Greedy drafts ``[R, B - 1]`` of rows ``hidden [R, B - 1, H]`` / ``logits [R, B - 1, V]`` (module docstring)."""
    if model.cfg.generation == 1:
        return argmax_path(logits)
    sel = model.candidate_selector
    rows = hidden.shape[0]
    return select_path(logits, sel.hidden_projection(hidden), anchor_tokens, sel.predecessor_codebook,
                       sel.successor_codebook, model.cfg.selector_top_k, [0.0] * rows, [0] * rows, [0] * rows)[0]


def accepted_lengths(target, ids: torch.Tensor, anchors: list[int], drafts: torch.Tensor) -> torch.Tensor:
    """``[W, N]``: greedy accepted lengths of ``drafts [W, N, B - 1]`` at ``anchors`` (shared by the windows)."""
    out = []
    n_draft = drafts.shape[-1]
    for i, s in enumerate(anchors):
        seq = torch.cat((ids[:, :s + 1], drafts[:, i]), dim=1)
        post = target.greedy(seq)[:, s:s + n_draft]            # the target's choice after x_s, d_1, ...
        out.append((drafts[:, i] == post).cpu().long().cumprod(dim=1).sum(dim=1))   # on the CPU: no CUDA scan
    return torch.stack(out, dim=1)


def evaluate(model, target, stream: np.ndarray, *, seq_len: int, stride: int, batch: int, max_windows: int,
             device: torch.device) -> dict:
    """The figures of one held-out stream (module docstring)."""
    b = model.cfg.block_size
    wins = dflash_corpus.windows(stream, seq_len, max_windows)
    grid = list(range(stride, seq_len - b + 1, stride))
    if not len(wins) or not grid:
        return {"windows": 0}
    hist = torch.zeros(b, dtype=torch.int64)
    tf_corpus = torch.zeros(b - 1)
    tf_target = torch.zeros(b - 1)
    mtp_acc = dflash_first = 0
    have_mtp = target.mtp is not None
    model.eval()
    with torch.no_grad():
        for at in range(0, len(wins), batch):
            ids = torch.from_numpy(wins[at:at + batch]).to(device)
            feats, greedy, final = target.features(ids, with_final=True)
            anchors = torch.tensor(grid, device=device).expand(ids.shape[0], -1)
            hidden = model.block_hidden(feats, ids, anchors)
            logits = model.logits(hidden).float()
            w, n = anchors.shape
            tokens = ids.gather(1, anchors)
            drafts = draft_paths(model, hidden.flatten(0, 1), logits.flatten(0, 1), tokens.flatten())
            drafts = drafts.view(w, n, b - 1)
            acc = accepted_lengths(target, ids, grid, drafts)
            hist += torch.bincount(acc.flatten(), minlength=b)
            pos = anchors[..., None] + torch.arange(1, b, device=device)
            top = logits.argmax(-1)
            tf_corpus += (top == ids.gather(1, pos.flatten(1)).view_as(pos)).sum((0, 1)).cpu()
            tf_target += (top == greedy.gather(1, (pos - 1).flatten(1)).view_as(pos)).sum((0, 1)).cpu()
            dflash_first += int((acc > 0).sum())
            if have_mtp:
                mtp = target.mtp_next_next(ids, final)             # mtp[:, t] drafts x_{t+2}
                mtp_acc += int((mtp[:, anchors[0] - 1] == greedy[:, anchors[0]]).sum())
    blocks = int(hist.sum())
    mean = float((hist * torch.arange(b)).sum()) / blocks
    reached = hist.flip(0).cumsum(0).flip(0)                       # reached[j]: blocks with accepted >= j
    out = {
        "windows": len(wins), "anchors_per_window": len(grid), "blocks": blocks,
        "mean_accepted_drafts": round(mean, 4), "mean_tokens_per_step": round(mean + 1, 4),
        "accepted_histogram": hist.tolist(),
        "acceptance_at_position": [round(float(reached[j + 1]) / max(1, int(reached[j])), 4) for j in range(b - 1)],
        "teacher_forced_top1_vs_corpus": [round(float(x) / blocks, 4) for x in tf_corpus],
        "teacher_forced_top1_vs_target_greedy": [round(float(x) / blocks, 4) for x in tf_target],
        "first_draft_acceptance": round(dflash_first / blocks, 4),
    }
    if have_mtp:
        out["mtp_one_draft_acceptance"] = round(mtp_acc / blocks, 4)
    model.train()
    return out
