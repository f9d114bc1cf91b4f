"""A Hugging Face model as the oracle: its logits and greedy continuation, computed the plainest way.

The model is the caller's (built with transformers in the test, with the weights that were saved and
converted), so this module never imports transformers. Every call runs the whole prefix without a cache:
slow, and independent of the reference's own cache code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def reference_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """fp32 logits ``[T, vocab]`` of ``model`` (a causal LM returning ``.logits``), row ``t`` predicting the
    token after ``token_ids[:t + 1]``."""
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)], dtype=torch.int64), use_cache=False)
    return out.logits[0].float()


def reference_greedy(model: torch.nn.Module, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The ``max_tokens`` tokens greedy decoding appends to ``prompt_ids`` (argmax, lowest id on ties; EOS is
    not special), as ``engine.generate`` with temperature 0 and ``ignore_eos`` produces them."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(torch.argmax(reference_logits(model, ids)[-1])))
    return ids[len(prompt_ids):]


def first_divergence(ours: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length when one is a prefix of the
    other), or None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(reference) else min(len(ours), len(reference))
