"""The drafter's training loss, the frozen target's features of the training windows, and the held-out loss curve.

Loss of a batch (the DFlash recipe): for the block of anchor ``s`` and mask slot ``j`` (1..B-1), the label is the
corpus token ``x_{s+j}`` (``labels="corpus"``) or the target's greedy token after ``x_{..s+j-1}``
(``labels="target"``), weighted ``exp(-(j - 1) / gamma)``; the loss is the weighted mean cross-entropy.
DFlash2 adds the selector's: the top-k of the (detached) slot logits are the candidates, scored as the engine
scores them (``logit + <pred[prev] * W h, succ[c]>``, ``prev`` the previous label, the anchor for slot 1, ``h``
the detached slot output); cross-entropy over the candidates against the label, same weights, slots whose label
is not a candidate left out. The selector thus learns to re-rank what the drafter proposes without pulling the
drafter's own outputs; the convs are trained by the drafter's loss.
"""

from __future__ import annotations

import dflash_corpus
import numpy as np
import torch
import train_default_model as tdm


def block_loss(model, feats, ids, greedy, anchors, keep, weight_mask, gamma: float, labels: str,
               selector_weight: float) -> dict:
    """The losses of one batch (module docstring) and the per-slot top-1 accuracy against the labels: ``feats`` /
    ``ids`` / ``greedy`` of windows ``[W, T]``, ``anchors`` / ``keep`` ``[W, N]`` (:func:`dflash_corpus.sample_anchors`),
    ``weight_mask [W, T]`` the positions whose tokens are trained (all, or the assistant turns)."""
    b = model.cfg.block_size
    hidden = model.block_hidden(feats, ids, anchors)                          # [W, N, B-1, H]
    logits = model.logits(hidden).float()
    pos = anchors[..., None] + torch.arange(1, b, device=ids.device)         # label positions s + j
    flat = pos.flatten(1)
    lab = (ids.gather(1, flat) if labels == "corpus" else greedy.gather(1, flat - 1)).view_as(pos)
    decay = torch.exp(-torch.arange(b - 1, device=ids.device, dtype=torch.float32) / gamma)
    w = keep[..., None].float() * decay * weight_mask.gather(1, flat).view_as(pos).float()
    ce = tdm.token_nll(logits, lab)
    loss_ce = (ce * w).sum() / w.sum().clamp_min(1e-6)
    out = {"ce": loss_ce, "loss": loss_ce}
    with torch.no_grad():
        hit = (logits.argmax(-1) == lab).float() * keep[..., None]
        out["top1"] = hit.sum((0, 1)) / keep.sum().clamp_min(1)
    if model.cfg.generation == 2:
        k = model.cfg.selector_top_k
        unary, cand = torch.topk(logits.detach(), k, dim=-1)
        prev = torch.cat((ids.gather(1, anchors)[..., None], lab[..., :-1]), dim=-1)
        scores = model.candidate_selector.scores(hidden.detach(), unary, cand, prev)
        found = cand == lab[..., None]
        ws = w * found.any(-1).float()
        nll = torch.logsumexp(scores, -1) - scores.gather(-1, found.long().argmax(-1, keepdim=True))[..., 0]
        out["selector"] = (nll * ws).sum() / ws.sum().clamp_min(1e-6)
        out["loss"] = loss_ce + selector_weight * out["selector"]
    return out


def precompute(target, wins: np.ndarray, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Target features and greedy tokens of windows ``wins [W, T]`` (the target is frozen: computed once)."""
    feats, greedy = [], []
    for at in range(0, len(wins), batch):
        f, g = target.features(torch.from_numpy(wins[at:at + batch]).to(device))
        feats.append(f)
        greedy.append(g)
    return torch.cat(feats), torch.cat(greedy)


class HeldoutCurve:
    """Teacher-forced held-out loss during training: the first ``windows`` windows of a held-out stream, anchors
    on the evaluation grid (``stride, 2 stride, ...``), every block kept."""

    def __init__(self, target, stream: np.ndarray, seq_len: int, windows: int, stride: int, block: int, batch: int,
                 device) -> None:
        wins = dflash_corpus.windows(stream, seq_len, windows)
        self.ids = torch.from_numpy(wins).to(device)
        self.feats, self.greedy = precompute(target, wins, batch, device)
        grid = torch.arange(stride, seq_len - block + 1, stride, device=device)
        self.anchors = grid.expand(len(wins), -1)
        self.keep = torch.ones_like(self.anchors, dtype=torch.bool)
        self.mask = torch.ones_like(self.ids, dtype=torch.bool)

    def __call__(self, model, gamma: float, labels: str, selector_weight: float, autocast) -> dict:
        model.eval()
        with torch.no_grad(), autocast():
            out = block_loss(model, self.feats, self.ids, self.greedy, self.anchors, self.keep, self.mask, gamma,
                             labels, selector_weight)
        model.train()
        row = {"heldout_ce": round(out["ce"].item(), 5), "heldout_top1": [round(x, 4) for x in out["top1"].tolist()]}
        if "selector" in out:
            row["heldout_selector"] = round(out["selector"].item(), 5)
        return row
