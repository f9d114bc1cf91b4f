"""Allowed-token bitmasks (constrained decoding): layout, filling from providers, applying to logits.

Layout (the one :class:`~ninfer.contracts.program.TokenMaskProvider` fills, and xgrammar's):
one row is ``ceil(V / 32)`` int32 words; token ``i`` is allowed when bit ``i % 32`` (least
significant first) of word ``i // 32`` is set. Bits at or past ``V`` are ignored.

:func:`apply_bitmask` sets banned logits to -inf. Invariants: allowed logits are left bit-exact, the
result does not depend on other rows, and it works on any device (the words are unpacked on the
logits' device, so a mask crosses the bus as V/8 bytes, not V).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.contracts.program import TokenMaskProvider

_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def words_per_row(vocab: int) -> int:
    return (vocab + 31) // 32


def _bit_values(device: torch.device) -> torch.Tensor:
    """int32 [32]: the value of bit j alone (bit 31 is the sign bit, -2**31)."""
    table = _BIT_VALUES.get(device)
    if table is None:
        table = torch.tensor([(1 << j) - (1 << 32) if j == 31 else 1 << j for j in range(32)],
                             dtype=torch.int32, device=device)
        _BIT_VALUES[device] = table
    return table


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [B, ceil(V/32)] -> bool allowed [B, V] on the words' device."""
    if words.dtype != torch.int32 or words.dim() != 2 or words.shape[1] != words_per_row(vocab):
        raise ValueError(f"expected int32 words [B, {words_per_row(vocab)}], got {words.dtype} {tuple(words.shape)}")
    # Element (b, w, j) is bit j of word w, i.e. token 32 * w + j: row-major order is token order.
    bits = (words.unsqueeze(-1) & _bit_values(words.device)) != 0
    return bits.reshape(words.shape[0], -1)[:, :vocab]


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Banned entries of ``logits[B, V]`` set to -inf, in place; returns ``logits``. ``words`` may be on
    the CPU: it is moved to the logits' device first."""
    allowed = unpack_bitmask(words.to(logits.device, non_blocking=True), logits.shape[-1])
    return logits.masked_fill_(~allowed, float("-inf"))


def fill_bitmasks(providers: Sequence[TokenMaskProvider], vocab: int) -> torch.Tensor:
    """One int32 row per provider, filled by it, on the CPU (pinned when CUDA is present, so the
    upload can overlap). Rows start all-zero: a provider that writes nothing bans everything, and the
    engine's matcher always allows at least the stop tokens."""
    pin = torch.cuda.is_available()
    words = torch.zeros((len(providers), words_per_row(vocab)), dtype=torch.int32, pin_memory=pin)
    for b, provider in enumerate(providers):
        provider.fill_bitmask(words[b])
    return words


__all__ = ["apply_bitmask", "fill_bitmasks", "unpack_bitmask", "words_per_row"]
