"""Turning a block's draft logits into drafts: DFlash's argmax per position, DFlash2's candidate path selector.

Both walk the ``n`` mask positions left to right so that a constrained row can mask position ``i``'s logits with
its grammar's mask after ``d_1..d_i`` (``constrain(drafted [R, i], logits [R, V]) -> logits``, e.g.
:class:`~ninfer.program.draft_masks.MaskedDrafting`) before ``d_{i+1}`` is chosen.

- DFlash: ``d_{i+1} = argmax`` of position ``i``'s (constrained) logits (NaN as -inf, lowest id on ties).
- DFlash2 (:func:`select_path`): the ``selector_top_k`` largest (constrained) logits of position ``i`` are the
  candidates; candidate ``c`` scores ``logit(c) + <pred[d_i] * (W h_i), succ[c]>`` (``pred`` / ``succ`` the
  predecessor / successor codebooks, ``W`` the hidden projection, ``h_i`` the block output, ``d_0`` the anchor).
  A greedy row takes the best score (lowest candidate rank on ties); a sampled row draws from
  ``q_i = softmax(scores / T)`` over the candidates, with Gumbel noise from its own stream
  (:func:`~ninfer_qwen3_5.dflash.sampling.selector_uniforms`), and reports ``q_i`` scattered over the vocabulary:
  the distribution its draft came from, which the rejection sampler then uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from ninfer.program.batch import to_device

from ninfer_qwen3_5.dflash.sampling import selector_uniforms

#: ``constrain(drafted [R, i], logits [R, V]) -> logits``.
Constrain = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x.float(), nan=float("-inf")).argmax(dim=-1)


def argmax_path(logits: torch.Tensor, constrain: Constrain | None = None) -> torch.Tensor:
    """DFlash's drafts int64 ``[R, n]`` from draft logits ``[R, n, V]``."""
    r, n, _ = logits.shape
    drafted = torch.zeros((r, 0), dtype=torch.int64, device=logits.device)
    for i in range(n):
        step = logits[:, i] if constrain is None else constrain(drafted, logits[:, i])
        drafted = torch.cat((drafted, _argmax(step)[:, None]), dim=1)
    return drafted


def select_path(logits: torch.Tensor, projected: torch.Tensor, anchors: torch.Tensor, predecessor: torch.Tensor,
                successor: torch.Tensor, top_k: int, temperatures: Sequence[float], seeds: Sequence[int],
                steps: Sequence[int], constrain: Constrain | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DFlash2's drafts int64 ``[R, n]`` and, when some row samples (``temperatures[r] > 0``), the proposal
    distributions ``[R, n, V]`` fp32 (zero rows for greedy rows; None when no row samples). ``logits``
    ``[R, n, V]`` the draft logits, ``projected`` ``[R, n, r]`` the hidden projection of the block outputs,
    ``anchors`` int64 ``[R]``; ``seeds`` / ``steps``: row r's draft ``d_{i+1}`` draws with step ``steps[r] + i``."""
    rows, n, vocab = logits.shape
    dev = logits.device
    k = min(top_k, vocab)
    sampled = [r for r, t in enumerate(temperatures) if t > 0]
    # Host data only when a row samples: an all-greedy path copies nothing from the host (a CUDA graph records it).
    temps = to_device([float(t) for t in temperatures], torch.float32, dev) if sampled else None
    idx = to_device(sampled, torch.int64, dev) if sampled else None
    q_full = torch.zeros((rows, n, vocab), dtype=torch.float32, device=dev) if sampled else None
    drafted = torch.zeros((rows, 0), dtype=torch.int64, device=dev)
    prev = anchors.to(torch.int64)
    for i in range(n):
        step = logits[:, i] if constrain is None else constrain(drafted, logits[:, i])
        unary, cand = torch.topk(torch.nan_to_num(step.float(), nan=float("-inf")), k, dim=-1)
        gate = predecessor.index_select(0, prev).float() * projected[:, i].float()          # [R, r]
        scores = unary + torch.einsum("br,bkr->bk", gate, successor[cand].float())          # [R, k]
        pick = _argmax(scores)
        if sampled:
            q = torch.softmax(scores / torch.where(temps > 0, temps, 1.0)[:, None], dim=-1)
            u = selector_uniforms([seeds[r] for r in sampled], [steps[r] + i for r in sampled], vocab, dev)
            noise = -torch.log(-torch.log(u.gather(1, cand.index_select(0, idx))))
            pick = pick.index_copy(0, idx, _argmax(q.index_select(0, idx).double().log() + noise))
            q_full[:, i].scatter_(1, cand, torch.where((temps > 0)[:, None], q, 0.0))
        prev = cand.gather(1, pick[:, None])[:, 0]
        drafted = torch.cat((drafted, prev[:, None]), dim=1)
    return drafted, q_full
