"""Torch reference ``token_logprobs``: the log-probability of each row's target token and the row's logsumexp.

Invariants: fp32 math whatever the logits' dtype (a 16-bit input is widened exactly); rows are independent;
targets are checked on the host (one sync), so an out-of-range id raises instead of reading garbage.
"""

from __future__ import annotations

import torch

from ninfer.ops.registry import OpImpl


def check_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} need [N, V] and targets [N], got "
                         f"{tuple(targets.shape)}")
    if targets.numel() and bool(((targets < 0) | (targets >= logits.shape[1])).any()):
        raise IndexError(f"token_logprobs: a target is outside the vocabulary [0, {logits.shape[1]})")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_targets(logits, targets)
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(1, targets.to(torch.int64)[:, None]).squeeze(1) - lse, lse


OPS = [OpImpl(op="token_logprobs", name="torch_reference", fn=token_logprobs, priority=0)]
