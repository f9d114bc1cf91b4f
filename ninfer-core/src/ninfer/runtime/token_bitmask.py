"""Allowed-token bitmasks (constrained decoding): layout, filling from providers, applying to logits.

Layout (the one :class:`~ninfer.runtime.contract.program.TokenMaskProvider` fills, and xgrammar's):
one row is ``ceil(V / 32)`` int32 words; token ``i`` is allowed when bit ``i % 32`` (least
significant first) of word ``i // 32`` is set. Bits at or past ``V`` are ignored.

:func:`apply_bitmask` sets banned logits to -inf. Invariants: allowed logits are left bit-exact, the
result does not depend on other rows, and it works on any device (the words are unpacked on the
logits' device through a 256-entry byte table, so a mask crosses the bus as V/8 bytes, not V).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.runtime.contract.program import TokenMaskProvider

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def words_per_row(vocab: int) -> int:
    return (vocab + 31) // 32


def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit j (LSB first) of each byte value."""
    table = _BYTE_BITS.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32)
        table = ((values[:, None] >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
        _BYTE_BITS[device] = table
    return table


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [B, ceil(V/32)] -> bool allowed [B, V] on the words' device."""
    if words.dtype != torch.int32 or words.dim() != 2 or words.shape[1] != words_per_row(vocab):
        raise ValueError(f"expected int32 words [B, {words_per_row(vocab)}], got {words.dtype} {tuple(words.shape)}")
    # Little-endian bytes of each word: byte k holds bits 8k..8k+7, matching bit i % 32 of word i // 32.
    as_bytes = words.contiguous().view(torch.uint8)
    if not torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0].item() == 1:
        raise RuntimeError("token bitmasks assume a little-endian host")
    bits = _byte_bits(words.device)[as_bytes.long()]  # [B, 4W, 8]
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
