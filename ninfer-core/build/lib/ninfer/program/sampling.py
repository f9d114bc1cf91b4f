"""Sampling a unit's rows from their logits: allowed-token masks, penalties, the draw, logprobs.

Pure functions over fp32 logits ``[B, V]`` (row ``b`` is ``rows[b]``, a ``(SeqId, RowSampling)``);
the Program passes what they need (its ops, the rows' ledgers, its decode graph's precomputed tokens).

Invariants:
- Order: allowed-token masks first (banned logits become -inf), then penalties (which keep -inf), then
  the ``sample`` op, so greedy, top-k/top-p/min-p and the Gumbel draw all work over the allowed set.
  Rows without a mask or penalties are untouched (a mixed batch changes nothing for them).
- A draw consumes no RNG state: each token's noise depends on (seed, step, token id) only, so it does
  not depend on the batch it is drawn in.
- Logprobs are those of the model's raw distribution (before masks, penalties and temperature), like
  vLLM's default.
- Drawing never waits for the stream (lookahead decode draws on the device the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ninfer.contracts.program import RowSampling, SeqId, TokenLogprob
from ninfer.program.batch import HostTokens, to_device
from ninfer.program.token_bitmask import apply_bitmask, fill_bitmasks

Rows = Sequence[tuple[SeqId, RowSampling]]
#: ``history(seq) -> (ledger, prompt_length)``: the tokens the penalties count.
History = Callable[[SeqId], tuple[Sequence[int], int]]
#: ``precomputed_greedy(logits)``: the greedy tokens of this very tensor when already computed, else None.
GreedyHint = Callable[[torch.Tensor], torch.Tensor | None]
#: ``precomputed_host_tokens(tokens)``: the host copy of these very tokens when already on its way, else None.
HostHint = Callable[[torch.Tensor], HostTokens | None]


def wants_logprobs(sampling: RowSampling) -> bool:
    return sampling.params.logprobs or sampling.params.top_logprobs > 0


def has_penalties(sampling: RowSampling) -> bool:
    p = sampling.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def mask_disallowed(raw: torch.Tensor, rows: Rows, vocab_size: int) -> torch.Tensor:
    """``raw`` with the tokens each constrained row's mask bans at -inf (a copy; ``raw`` itself when no
    row is constrained). Unconstrained rows of a mixed batch are untouched (no all-ones mask)."""
    constrained = [b for b, (_, rs) in enumerate(rows) if rs.mask is not None]
    if not constrained:
        return raw
    return mask_rows(raw, constrained, fill_bitmasks([rows[b][1].mask for b in constrained], vocab_size))


def mask_rows(raw: torch.Tensor, index: Sequence[int], words: torch.Tensor) -> torch.Tensor:
    """``raw`` [B, V] with the tokens ``words[j]`` (int32 bitmask rows, ``token_bitmask``'s layout) bans set
    to -inf in row ``index[j]``: a copy; ``raw`` itself when ``index`` is empty. Other rows are untouched."""
    if not index:
        return raw
    idx = torch.tensor(list(index), dtype=torch.int64, device=raw.device)
    processed = raw.clone()
    processed[idx] = apply_bitmask(processed[idx], words)
    return processed


def penalize(processed: torch.Tensor, rows: Rows, history: History, ops, vocab_size: int) -> torch.Tensor:
    """The ``apply_penalties`` op over every row (penalty-free rows pass neutral values), counting each
    row's prompt and output tokens from its ledger; ``processed`` itself when no row has penalties."""
    params = [rs.params for _, rs in rows]
    if not any(has_penalties(rs) for _, rs in rows):
        return processed
    counts = torch.zeros((len(rows), vocab_size), dtype=torch.int32)
    prompt = torch.zeros((len(rows), vocab_size), dtype=torch.bool)
    for b, (sid, _) in enumerate(rows):
        ledger, prompt_length = history(sid)
        prompt[b, torch.tensor(ledger[:prompt_length], dtype=torch.int64)] = True
        out = ledger[prompt_length:]
        if out:
            counts[b] = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=vocab_size).to(torch.int32)
    dev = processed.device
    return ops.apply_penalties(
        processed, counts.to(dev), prompt.to(dev),
        torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev))


def draw(processed: torch.Tensor, rows: Rows, ops, vocab_size: int, precomputed_greedy: GreedyHint) -> torch.Tensor:
    """The ``sample`` op's tokens (int64 [B], on the device) from fp32 logits already masked and
    penalised; never waits for the stream."""
    params = [rs.params for _, rs in rows]
    if all(p.temperature <= 0 for p in params):
        # Every row greedy: the sampler's result is the lowest-id maximum after NaN -> -inf, which is
        # greedy_tokens' (skipping the filter saves its full-vocabulary sort); a decode graph computed it
        # already when these are its logits.
        pre = precomputed_greedy(processed)
        return pre if pre is not None else ops.greedy_tokens(processed)
    # Two host->device copies for the six per-row parameters.
    dev = processed.device
    fparams = to_device([[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                        torch.float32, dev)
    # top_k >= vocab keeps every token, as vocab does: clamped, so any valid top_k fits the int32 the sampler
    # takes (an unclamped 2**63 would fail converting to int64).
    iparams = to_device([[min(p.top_k, vocab_size) for p in params], [rs.seed for _, rs in rows],
                         [rs.step for _, rs in rows]], torch.int64, dev)
    return ops.sample(processed, fparams[0], iparams[0].to(torch.int32), fparams[1], fparams[2],
                      iparams[1], iparams[2]).to(torch.int64)


def token_logprobs(lp: torch.Tensor | None, want: list[int], rows: Rows, tokens: list[int]
                   ) -> list[TokenLogprob | None]:
    """Row ``want[i]``'s TokenLogprob from host log-softmax row ``lp[i]``; None for the other rows."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    for i, b in enumerate(want):
        k = rows[b][1].params.top_logprobs
        top = ()
        if k > 0:
            vals, ids = torch.topk(lp[i], k)
            top = tuple((int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist(), strict=True))
        out[b] = TokenLogprob(token=tokens[b], logprob=float(lp[i, tokens[b]]), top=top)
    return out


def sample_rows(logits: torch.Tensor, rows: Rows, *, ops, vocab_size: int, history: History,
                precomputed_greedy: GreedyHint, precomputed_host_tokens: HostHint
                ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Masks, penalties, the draw, then the tokens and the asked logprobs on the host (waits for them)."""
    raw = logits.float()
    processed = penalize(mask_disallowed(raw, rows, vocab_size), rows, history, ops, vocab_size)
    tokens = draw(processed, rows, ops, vocab_size, precomputed_greedy)
    host = precomputed_host_tokens(tokens)   # a decode graph's greedy tokens: already on their way
    token_list = host.values() if host is not None else [int(t) for t in tokens.tolist()]
    want = [b for b, (_, rs) in enumerate(rows) if wants_logprobs(rs)]
    lp = torch.log_softmax(raw[want], dim=-1).cpu() if want else None
    return token_list, token_logprobs(lp, want, rows, token_list)
