"""Torch reference ``greedy_tokens``: each row's argmax token, the temperature-0 decode step.

Invariants: the token of row b is ``torch.argmax(torch.nan_to_num(logits[b], nan=-inf))`` in the logits' own
dtype, i.e. the lowest index of the row's maximum where NaN counts as -inf (below every other value), +inf as
the dtype's largest finite value and -inf as its most negative finite value (so -inf still beats NaN, and
+inf ties with that largest value); an all-NaN row gives 0. The result is int64 [B], written into ``out`` when
given (which is then returned). No host sync: the call is CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from ninfer.ops.registry import OpImpl


def check_greedy_args(logits: torch.Tensor, out: torch.Tensor | None) -> None:
    """ValueError naming the problem unless logits is float [B, V >= 1] and out (if given) int64 [B] on its
    device."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_tokens: logits must be 2-D [B, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"greedy_tokens: logits must be a float tensor, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("greedy_tokens: logits have an empty vocabulary (V = 0)")
    if out is None:
        return
    if out.dtype != torch.int64:
        raise ValueError(f"greedy_tokens: out must be int64, got {out.dtype}")
    if out.shape != (logits.shape[0],):
        raise ValueError(f"greedy_tokens: out must have shape ({logits.shape[0]},), got {tuple(out.shape)}")
    if out.device != logits.device:
        raise ValueError(f"greedy_tokens: out is on {out.device}, logits on {logits.device}")


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row argmax of ``nan_to_num(logits, nan=-inf)`` (lowest index on ties) as int64 [B], into ``out``
    if given."""
    check_greedy_args(logits, out)
    tokens = torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1)
    if out is None:
        return tokens
    out.copy_(tokens)
    return out


OPS = [OpImpl(op="greedy_tokens", name="torch_reference", fn=greedy_tokens, priority=0)]
