"""MinTokensMask: an output's stop tokens held back until it is ``min_tokens`` long (vLLM's ``min_tokens``).

A mask provider (:class:`~ninfer.contracts.program.DraftMaskProvider`) an OutputSession gives the engine while its
committed output is shorter than ``min_tokens``: the allowed tokens are those of the request's grammar (every token
when it has none) less the tokens that would end it (EOS unless ``ignore_eos``, ``stop_token_ids``, and the grammar's own
end tokens), so the sampler cannot end the output early. Stop strings are text, matched after sampling: the session
does not let one end an output that is still short.

Invariants: at least one token is allowed. When the grammar allows only stop tokens (it can only end here), they stay
allowed and the output ends shorter than ``min_tokens``. The provider is built per round from the session's committed
length and never changes it; past ``min_tokens`` the session gives the grammar's own provider (or none) instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.contracts.program import TokenMaskProvider


def _int32(value: int) -> int:
    """``value`` as the int32 it is bit for bit (a mask word's bit 31 is its sign)."""
    return ((value + (1 << 31)) % (1 << 32)) - (1 << 31)


class MinTokensMask:
    """Implements ``DraftMaskProvider``. ``committed``: the output's length so far (stop tokens cannot be sampled at
    positions ``committed .. min_tokens - 1``); ``grammar``: the request's own mask provider, or None."""

    def __init__(self, grammar: TokenMaskProvider | None, stop_ids: Sequence[int], *, committed: int,
                 min_tokens: int) -> None:
        self._grammar = grammar
        self._stops = tuple(sorted({int(t) for t in stop_ids}))
        self._committed = committed
        self._min = min_tokens

    def _hold(self, words: torch.Tensor, position: int) -> None:
        """Clear the stop tokens' bits of ``words`` (the mask of output position ``position``) while it is short."""
        if position >= self._min or not self._stops:
            return
        held = words.clone()
        for t in self._stops:
            if t // 32 < words.numel():
                words[t // 32] &= _int32(~(1 << (t % 32)))
        if not bool(words.any()):   # the grammar can only end here: let it
            words.copy_(held)

    def fill_bitmask(self, words: torch.Tensor) -> None:
        if self._grammar is None:
            words.fill_(-1)
        else:
            self._grammar.fill_bitmask(words)
        self._hold(words, self._committed)

    def fill_bitmask_after(self, tokens: Sequence[int], words: torch.Tensor) -> bool:
        """The mask after the committed output and ``tokens``; False when a stop token among them ended the output
        (no next token) or the grammar rejects them (as ``DraftMaskProvider`` says)."""
        if any(int(t) in self._stops for t in tokens):
            return False
        if self._grammar is None:
            words.fill_(-1)
        else:
            after = getattr(self._grammar, "fill_bitmask_after", None)
            if after is None or not after(tokens, words):
                return False
        self._hold(words, self._committed + len(tokens))
        return True
