"""Torch reference ``greedy_tokens``: each row's argmax token, the temperature-0 decode step.

Invariants: the token of row b is ``torch.argmax(torch.nan_to_num(logits[b], nan=-inf))`` in the logits' own
dtype, i.e. the lowest index of the row's maximum where NaN counts as -inf (below every other value), +inf as
the dtype's largest finite value and -inf as its most negative finite value (so -inf still beats NaN, and
+inf ties with that largest value); an all-NaN row gives 0. The result is int64 [B], written into ``out`` when
given (which is then returned). No host sync: the call is CUDA-graph capturable.

``host = (ring, row)``: the tokens are also stored into ``ring[row[0], :B]`` (``ring`` an int64 [R, >= B] host
tensor, ``row`` an int64 [1] tensor on the logits' device, read when the call runs): a decode graph's way of
handing its tokens to the host without a copy operation between replays. Here that store reads ``row`` and
copies to the host, so it synchronises; an implementation whose device code stores into pinned host memory
itself (no sync, capturable) marks its function ``host_capturable = True`` (the Triton one).
"""

from __future__ import annotations

import torch

from ninfer.ops.registry import OpImpl


def check_greedy_args(logits: torch.Tensor, out: torch.Tensor | None, host: tuple | None = None) -> None:
    """ValueError naming the problem unless logits is float [B, V >= 1], out (if given) int64 [B] on its
    device and host (if given) an int64 [R, >= B] CPU ring with an int64 [1] row index on the logits' device."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_tokens: logits must be 2-D [B, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"greedy_tokens: logits must be a float tensor, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("greedy_tokens: logits have an empty vocabulary (V = 0)")
    if host is not None:
        ring, row = host
        if ring.device.type != "cpu" or ring.dtype != torch.int64 or ring.dim() != 2 or ring.shape[1] < logits.shape[0]:
            raise ValueError(f"greedy_tokens: host ring must be an int64 [R, >= {logits.shape[0]}] CPU tensor, got "
                             f"{ring.dtype} {tuple(ring.shape)} on {ring.device}")
        if ring.stride(1) != 1:
            raise ValueError("greedy_tokens: host ring rows must be contiguous")
        if row.dtype != torch.int64 or row.shape != (1,) or row.device != logits.device:
            raise ValueError(f"greedy_tokens: host row must be an int64 [1] tensor on {logits.device}, got "
                             f"{row.dtype} {tuple(row.shape)} on {row.device}")
    if out is None:
        return
    if out.dtype != torch.int64:
        raise ValueError(f"greedy_tokens: out must be int64, got {out.dtype}")
    if out.shape != (logits.shape[0],):
        raise ValueError(f"greedy_tokens: out must have shape ({logits.shape[0]},), got {tuple(out.shape)}")
    if out.device != logits.device:
        raise ValueError(f"greedy_tokens: out is on {out.device}, logits on {logits.device}")


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None, host: tuple | None = None) -> torch.Tensor:
    """Row argmax of ``nan_to_num(logits, nan=-inf)`` (lowest index on ties) as int64 [B], into ``out``
    if given, and into the host ring's row (see the module docstring) if ``host`` is given."""
    check_greedy_args(logits, out, host)
    tokens = torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1)
    if host is not None:
        ring, row = host
        r = int(row[0])
        if not 0 <= r < ring.shape[0]:
            raise ValueError(f"greedy_tokens: host row {r} is outside the ring's {ring.shape[0]} rows")
        ring[r, : tokens.shape[0]] = tokens.cpu()
    if out is None:
        return tokens
    out.copy_(tokens)
    return out


OPS = [OpImpl(op="greedy_tokens", name="torch_reference", fn=greedy_tokens, priority=0)]
