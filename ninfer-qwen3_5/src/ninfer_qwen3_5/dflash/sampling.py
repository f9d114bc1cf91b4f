"""Sampled drafts (DFlash2's selector at temperature > 0) and their lossless acceptance.

Random draws follow :mod:`ninfer.program.sampling`'s rule (no generator state; a uniform per (seed, step, token
id) from the ``sample`` op's counter-based hash, ``hash_uniform``), in three independent streams of a request:

- the target's own draws: ``u(seed, step, id)``, the ``sample`` op's, used for the token added after the
  accepted drafts (the residual at a rejection, the bonus after all);
- the selector's draws (:func:`selector_uniforms`): ``u(seed ^ SELECT, step, id)``, Gumbel noise of the draft
  at step ``step``;
- the acceptance draws (:func:`accept_uniforms`): ``u(seed ^ ACCEPT, step, 0)``, the uniform that accepts or
  rejects the draft at step ``step``.

A step's draws are read by one verify only: the committed tokens cover steps ``step..step + n``, and the draws
of later steps that a verify may have read (a draft past the first rejection) decided nothing committed.

:func:`sampled_acceptance` is :func:`~ninfer.program.speculation.rejection_acceptance` with the selector's q and
the target distribution ``p`` after every sampling transform (masks and penalties already applied to the logits,
then temperature, top-k, top-p and min-p exactly as the ``sample`` op filters them): each committed token is
distributed as plain sampling draws it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ninfer.ops.reference.sampling import filter_logits, hash_uniform
from ninfer.program.batch import to_device
from ninfer.program.speculation import rejection_acceptance

# Stream keys (XOR-ed into the request seed; below 2^62, so an int64 seed stays an int64).
SELECT = 0x2545F4914F6CDD1D & ((1 << 62) - 1)
ACCEPT = 0x1B873593CC9E2D51 & ((1 << 62) - 1)


def _uniforms(seeds: Sequence[int], steps: Sequence[int], vocab: int, key: int, device) -> torch.Tensor:
    s = to_device([int(x) ^ key for x in seeds], torch.int64, torch.device(device))
    t = to_device([int(x) for x in steps], torch.int64, torch.device(device))
    return hash_uniform(s, t, vocab)


def selector_uniforms(seeds: Sequence[int], steps: Sequence[int], vocab: int, device) -> torch.Tensor:
    """fp64 ``[R, V]``: the selector's uniforms of row r's draft at step ``steps[r]`` (module docstring)."""
    return _uniforms(seeds, steps, vocab, SELECT, device)


def accept_uniforms(seeds: Sequence[int], steps: Sequence[int], device) -> torch.Tensor:
    """fp64 ``[R]``: the acceptance uniform of row r's draft at step ``steps[r]`` (module docstring)."""
    return _uniforms(seeds, steps, 1, ACCEPT, device)[:, 0]


def target_probabilities(processed: torch.Tensor, params: Sequence) -> torch.Tensor:
    """``p`` fp32 ``[P, V]`` of masked and penalised logits ``processed`` under each row's ``SamplingParams``
    (``params[j]`` for row j): the distribution the ``sample`` op draws from (temperature, then its top-k /
    top-p / min-p filter)."""
    vocab, dev = processed.shape[-1], processed.device
    x, keep, _ = filter_logits(
        processed, torch.tensor([q.temperature for q in params], dtype=torch.float32, device=dev),
        torch.tensor([min(q.top_k, vocab) for q in params], dtype=torch.int64, device=dev),
        torch.tensor([q.top_p for q in params], dtype=torch.float32, device=dev),
        torch.tensor([q.min_p for q in params], dtype=torch.float32, device=dev))
    return torch.softmax(torch.where(keep, x, float("-inf")), dim=-1)


def sampled_acceptance(processed: torch.Tensor, rows, ns: Sequence[int], starts: Sequence[int], drafts,
                       num: Sequence[int]) -> dict[int, list[int]]:
    """Committed tokens of every verify row ``r`` in ``drafts.q`` (module docstring): ``processed`` the verify
    positions' masked and penalised logits (``rows[j]`` = ``((seq, i), RowSampling)`` of position j), row r's
    ``ns[r] + 1`` positions from ``starts[r]``, its drafts ``drafts.tokens[r]``, of which it verifies ``num[r]``.
    One :func:`~ninfer.program.speculation.rejection_acceptance` call per draft count."""
    out: dict[int, list[int]] = {}
    dev, vocab = processed.device, processed.shape[-1]
    for n in sorted({ns[r] for r in drafts.q}):
        group = [r for r in drafts.q if ns[r] == n]
        pos = [starts[r] + i for r in group for i in range(n + 1)]
        samp = [rows[j][1] for j in pos]
        p = target_probabilities(processed[torch.tensor(pos, dtype=torch.int64, device=dev)],
                                 [s.params for s in samp]).view(len(group), n + 1, vocab)
        noise = _uniforms([s.seed for s in samp], [s.step for s in samp], vocab, 0, dev).view(len(group), n + 1, vocab)
        first = [rows[starts[r]][1] for r in group]
        u = accept_uniforms([s.seed for s in first for _ in range(n)], [s.step + i for s in first for i in range(n)],
                            dev).view(len(group), n)
        q = torch.stack([drafts.q[r] for r in group]).to(dev)
        d = torch.tensor([drafts.tokens[r] for r in group], dtype=torch.int64, device=dev)
        acc = rejection_acceptance(p, d, noise, q=q, accept_u=u,
                                   num_drafts=torch.tensor([num[r] for r in group], dtype=torch.int64, device=dev))
        out.update(zip(group, acc.to_host(), strict=True))
    return out
