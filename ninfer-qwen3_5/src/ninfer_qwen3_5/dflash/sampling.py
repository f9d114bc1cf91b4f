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
from ninfer.program.speculation import rejection_acceptance

# Stream keys (XOR-ed into the request seed; below 2^62, so an int64 seed stays an int64).
SELECT = 0x2545F4914F6CDD1D & ((1 << 62) - 1)
ACCEPT = 0x1B873593CC9E2D51 & ((1 << 62) - 1)


def _uniforms(seeds: Sequence[int], steps: Sequence[int], vocab: int, key: int, device) -> torch.Tensor:
    s = torch.tensor([int(x) ^ key for x in seeds], dtype=torch.int64, device=device)
    t = torch.tensor([int(x) for x in steps], dtype=torch.int64, device=device)
    return hash_uniform(s, t, vocab)


def selector_uniforms(seeds: Sequence[int], steps: Sequence[int], vocab: int, device) -> torch.Tensor:
    """fp64 ``[R, V]``: the selector's uniforms of row r's draft at step ``steps[r]`` (module docstring)."""
    return _uniforms(seeds, steps, vocab, SELECT, device)


def accept_uniforms(seeds: Sequence[int], steps: Sequence[int], device) -> torch.Tensor:
    """fp64 ``[R]``: the acceptance uniform of row r's draft at step ``steps[r]`` (module docstring)."""
    return _uniforms(seeds, steps, 1, ACCEPT, device)[:, 0]


def target_probabilities(processed: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
                         ) -> torch.Tensor:
    """``p`` fp32 ``[P, V]`` of masked and penalised logits ``processed`` under one request's sampling parameters:
    the distribution the ``sample`` op draws from (temperature, then its top-k / top-p / min-p filter)."""
    rows, vocab = processed.shape
    dev = processed.device

    def full(v, dtype):
        return torch.full((rows,), v, dtype=dtype, device=dev)

    x, keep, _ = filter_logits(processed, full(temperature, torch.float32), full(min(top_k, vocab), torch.int64),
                               full(top_p, torch.float32), full(min_p, torch.float32))
    return torch.softmax(torch.where(keep, x, float("-inf")), dim=-1)


def sampled_acceptance(processed: torch.Tensor, rows, ns: Sequence[int], starts: Sequence[int], drafts,
                       num: Sequence[int]) -> dict[int, list[int]]:
    """Committed tokens of every verify row ``r`` in ``drafts.q`` (module docstring): ``processed`` the verify
    positions' masked and penalised logits (``rows[j]`` = ``((seq, i), RowSampling)`` of position j), row r's
    ``ns[r] + 1`` positions from ``starts[r]``, its drafts ``drafts.tokens[r]``, of which it verifies ``num[r]``."""
    out: dict[int, list[int]] = {}
    for r, q in drafts.q.items():
        n, at = ns[r], starts[r]
        rs = rows[at][1]
        params = rs.params
        p = target_probabilities(processed[at:at + n + 1], params.temperature, params.top_k, params.top_p,
                                 params.min_p)
        dev = p.device
        steps = [rs.step + i for i in range(n + 1)]
        noise = _uniforms([rs.seed] * (n + 1), steps, p.shape[-1], 0, dev)
        u = accept_uniforms([rs.seed] * n, steps[:n], dev)
        d = torch.tensor([drafts.tokens[r]], dtype=torch.int64, device=dev)
        acc = rejection_acceptance(p[None], d, noise[None], q=q[None].to(dev), accept_u=u[None],
                                   num_drafts=torch.tensor([num[r]], dtype=torch.int64, device=dev))
        out[r] = acc.to_host()[0]
    return out
