"""What a verified speculative row commits: greedy and rejection-sampling acceptance of drafted tokens.

A speculative step verifies, per row r, ``k`` drafted tokens ``d_1..d_k`` (``drafts[r, :k]``) by running
the target on ``[t_last, d_1..d_k]``: target position ``i`` (0-based, ``0..k``) predicts the token after
``d_i`` (after ``t_last`` for ``i = 0``). Row r may draft fewer tokens (``num_drafts[r] <= k``: a row near its
output budget or ``max_context`` speculates less); its drafts past ``num_drafts[r]`` are padding, never
read, and its target positions past ``num_drafts[r]`` never decide anything.

Both rules accept the longest prefix ``d_1..d_n`` of drafts that passes, then add one token of the target's
own (the correction at the first failure, or the bonus after the last draft): ``n + 1`` tokens, between 1
and ``num_drafts[r] + 1``, are committed.

- :func:`greedy_acceptance`: draft ``d_{i+1}`` passes when it equals the target's argmax at position ``i``; the
  added token is the argmax at position ``n``. The committed tokens are therefore the target's argmaxes at
  positions ``0..n``: exactly what non-speculative greedy decoding emits.
- :func:`rejection_acceptance`: the speculative sampling rule. With target distributions ``p_i`` and draft
  distributions ``q_i`` (both after the request's sampling transforms), draft ``d_{i+1}`` passes with
  probability ``min(1, p_i(d) / q_i(d))``; at the first rejection the added token is drawn from the residual
  ``normalize(max(0, p_i - q_i))`` (from ``p_i`` when that has no mass); after all drafts pass it is drawn
  from ``p_n``. Each committed token is then distributed exactly as non-speculative sampling would draw it.

Randomness comes from the caller as uniform draws, following :mod:`ninfer.program.sampling`'s rule that a
draw consumes no RNG state: the caller derives them from the request's seed and the token's step (e.g.
``ninfer.ops.reference.sampling.hash_uniform(seeds, steps + i, V)`` for position ``i``), so a seeded request
is reproducible and independent of its batch. Which draws a row reads is stated on the function.

Everything stays on the tensors' device and never waits for it; :meth:`Acceptance.to_host` is the one
device-to-host transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Padding of :attr:`Acceptance.tokens` past a row's committed tokens.
PAD = -1


@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying ``R`` rows with up to ``k`` drafts each (tensors on the inputs' device).

    Invariants, per row r:

    - ``accepted[r]`` (int64 [R]) is ``n`` in ``0..num_drafts[r]``: the drafts ``d_1..d_n`` were accepted.
    - ``tokens[r]`` (int64 [R, k + 1]) holds the ``n + 1`` committed tokens first, ``d_1..d_n`` then the
      target's added token (correction or bonus), and :data:`PAD` (-1) after them. Every committed token
      is a valid vocabulary id.
    - :attr:`produced` ``= accepted + 1`` is the number of committed tokens (at least 1).
    """

    accepted: torch.Tensor
    tokens: torch.Tensor

    @property
    def produced(self) -> torch.Tensor:
        return self.accepted + 1

    def to_host(self) -> list[list[int]]:
        """Each row's committed tokens as a host list, with one device-to-host transfer."""
        rows = self.tokens.tolist()
        return [row[:row.index(PAD)] if PAD in row else row for row in rows]


def greedy_acceptance(drafts: torch.Tensor, target: torch.Tensor,
                      num_drafts: torch.Tensor | None = None) -> Acceptance:
    """Greedy acceptance (module docstring).

    ``drafts``: int64 [R, k]. ``target``: the target's logits [R, k + 1, V] (float; argmax with NaN as
    -inf, lowest id on ties, as the ``greedy_tokens`` op) or its argmax tokens [R, k + 1] (int64).
    ``num_drafts``: int64 [R] with values in 0..k (None: k for every row); not checked on the device.
    Consumes no randomness."""
    k = _check_drafts(drafts, num_drafts)
    if target.is_floating_point():
        _check_shape("target logits", target, (drafts.shape[0], k + 1), extra=1)
        target = _argmax(target)
    else:
        _check_shape("target tokens", target, (drafts.shape[0], k + 1))
    target = target.to(torch.int64)
    passed = drafts == target[:, :k]
    accepted = _prefix_length(passed, num_drafts)
    positions = torch.arange(k + 1, device=drafts.device)
    # Accepted drafts equal the target's argmax at their positions, so the committed tokens are the argmaxes.
    tokens = torch.where(positions[None, :] <= accepted[:, None], target, PAD)
    return Acceptance(accepted=accepted, tokens=tokens)


def rejection_acceptance(p: torch.Tensor, drafts: torch.Tensor, noise: torch.Tensor, *,
                         q: torch.Tensor | None = None, accept_u: torch.Tensor | None = None,
                         num_drafts: torch.Tensor | None = None) -> Acceptance:
    """Rejection-sampling acceptance (module docstring).

    ``p``: float [R, k + 1, V], the target's probabilities at positions 0..k after every sampling transform
    (rows sum to 1, masked tokens 0). ``drafts``: int64 [R, k]. ``noise``: uniforms in (0, 1) [R, k + 1, V],
    one per position and token id. ``q``: float [R, k, V], the drafter's probabilities of the drafts, or
    None for a deterministic drafter (one-hot at the drafts). ``accept_u``: uniforms in (0, 1) [R, k], needed
    with ``q`` and ignored without. ``num_drafts``: int64 [R] in 0..k (None: k); not checked on the device.

    A token is drawn from a distribution ``w`` with the noise ``u`` of its position by Gumbel-max,
    ``argmax_v log w(v) - log(-log u(v))`` (lowest id on ties), the ``sample`` op's rule.

    Draws read by row r, with ``n = accepted[r]`` and ``m = num_drafts[r]``:

    - ``q`` given: ``accept_u[r, i]`` for ``i`` in ``0..min(n, m - 1)`` (draft ``d_{i+1}`` passes when
      ``accept_u * q_i(d) < p_i(d)``), and ``noise[r, n]`` only (the added token). Nothing else.
    - ``q`` None: ``noise[r, i]`` for ``i`` in ``0..n``, nothing else. Position ``i`` draws ``x_i`` from ``p_i``;
      the draft passes when ``x_i == d_{i+1}``, and the added token is ``x_n``. This accepts ``d`` with
      probability ``p_i(d) = min(1, p_i(d) / 1)`` and, on rejection, ``x_i`` follows ``p_i`` without ``d``,
      which is the residual ``normalize(max(0, p_i - onehot(d)))``: the rule above, coupled so that every
      committed token is the very token a non-speculative draw from ``p_i`` with the same noise gives.

    Positions past ``n`` read nothing, so a caller that keys noise on the token's step may reuse those
    steps' draws later. With ``q`` None the rule never reads the drafter's distribution, so it is exact for
    any drafter (a sampling one just gets fewer drafts accepted). Scores are computed in fp64 over
    ``[R, k + 1, V]`` with ``q`` None and over ``[R, V]`` with ``q``."""
    k = _check_drafts(drafts, num_drafts)
    rows = drafts.shape[0]
    _check_shape("p", p, (rows, k + 1), extra=1)
    _check_shape("noise", noise, tuple(p.shape))
    vocab = p.shape[-1]
    positions = torch.arange(k + 1, device=drafts.device)
    if q is None:
        x = _gumbel_argmax(p, noise)  # [R, k + 1]
        passed = drafts == x[:, :k]
        accepted = _prefix_length(passed, num_drafts)
        added = x.gather(1, accepted[:, None])[:, 0]
    else:
        _check_shape("q", q, (rows, k, vocab))
        if accept_u is None:
            raise ValueError("rejection_acceptance: accept_u [R, k] is needed with a draft distribution q")
        _check_shape("accept_u", accept_u, (rows, k))
        index = drafts.clamp(0, vocab - 1)[:, :, None]  # padded drafts are never read: any valid id
        p_d = p[:, :k].gather(2, index)[:, :, 0].double()
        q_d = q.gather(2, index)[:, :, 0].double()
        passed = accept_u.double() * q_d < p_d
        accepted = _prefix_length(passed, num_drafts)
        at = accepted[:, None, None].expand(rows, 1, vocab)
        p_n = p.gather(1, at)[:, 0].double()
        # q at position n; a row that accepted all of its drafts draws its bonus from p itself (q_n = 0).
        q_pad = torch.cat([q, q.new_zeros(rows, 1, vocab)], dim=1)
        all_passed = accepted == _num_drafts(num_drafts, rows, k, drafts.device)
        q_n = torch.where(all_passed[:, None], 0.0, q_pad.gather(1, at)[:, 0].double())
        residual = (p_n - q_n).clamp_min(0.0)
        # No residual mass means p_n == q_n (both sum to 1), where a rejection has probability 0; rounding
        # may still reject, and then p_n is the distribution.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_n, residual)
        added = _gumbel_argmax(residual, noise.gather(1, at)[:, 0])
    safe = drafts.clamp_min(0)
    tokens = torch.where(positions[None, :k] < accepted[:, None], safe, PAD)
    tokens = torch.cat([tokens, torch.full_like(accepted[:, None], PAD)], dim=1)
    tokens = tokens.scatter(1, accepted[:, None], added[:, None])
    return Acceptance(accepted=accepted, tokens=tokens)


def _num_drafts(num_drafts: torch.Tensor | None, rows: int, k: int, device: torch.device) -> torch.Tensor:
    if num_drafts is None:
        return torch.full((rows,), k, dtype=torch.int64, device=device)
    return num_drafts.to(torch.int64)


def _prefix_length(passed: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """Per row, how many leading entries of ``passed`` [R, k] hold, counting only the first ``num_drafts``."""
    rows, k = passed.shape
    if num_drafts is not None:
        passed = passed & (torch.arange(k, device=passed.device)[None, :] < num_drafts.to(torch.int64)[:, None])
    if k == 0:
        return torch.zeros(rows, dtype=torch.int64, device=passed.device)
    return passed.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim with NaN as -inf; torch.argmax returns the first (lowest) maximal id."""
    return torch.nan_to_num(logits.float(), nan=float("-inf")).argmax(dim=-1)


def _gumbel_argmax(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A draw per leading index from ``weights`` [..., V] (non-negative, any positive total) with the uniforms
    ``noise`` [..., V] in (0, 1): argmax of log w - log(-log u) in fp64, lowest id on ties. A zero weight is
    never drawn unless the whole row is zero (then id 0)."""
    scores = weights.double().log() - (-noise.double().log()).log()
    return _argmax(scores)


def _check_drafts(drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> int:
    if drafts.dim() != 2 or drafts.dtype != torch.int64:
        raise ValueError(f"drafts must be int64 [R, k], got {drafts.dtype} {list(drafts.shape)}")
    if num_drafts is not None:
        if num_drafts.shape != (drafts.shape[0],) or num_drafts.is_floating_point():
            raise ValueError(f"num_drafts must be an integer tensor [R] = [{drafts.shape[0]}], got "
                             f"{num_drafts.dtype} {list(num_drafts.shape)}")
    return drafts.shape[1]


def _check_shape(name: str, t: torch.Tensor, leading: tuple[int, ...], extra: int = 0) -> None:
    if t.dim() != len(leading) + extra or tuple(t.shape[:len(leading)]) != tuple(leading):
        want = ", ".join([str(n) for n in leading] + (["V"] if extra else []))
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")
