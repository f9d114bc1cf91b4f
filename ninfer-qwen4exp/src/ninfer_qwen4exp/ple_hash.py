"""The constants of one PLE layer's n-gram hash, derived from the config alone (docs/architectures/qwen4exp.md).

A PLE layer with PLE index ``l`` (its position in ``ple_layer_ids``) has G = (ngram_size - 1) * heads_per_ngram hash
heads: heads ``[(n - 2) * heads_per_ngram, (n - 1) * heads_per_ngram)`` hash the n-grams of order n. Head h owns a
vocabulary of ``size_h`` rows, the (l*G + h + 1)-th prime at or above ``ngram_vocab_size_base``, starting at row
``offset_h`` (the sizes' running sum) of the layer's table, whose row count is their total rounded up to a multiple
of ``make_ngram_vocab_size_divisible_by``. The order-p multiplier (p < ngram_size) is
``2 * (splitmix64(seed + 10007 * l + GAMMA * (p + 1)) mod half) + 1`` with ``half = ((2^63 - 1) // vocab) // 2``
(at least 1): odd, and small enough that ``token * multiplier`` stays below 2^63 for every token id.

The checkpoint stores these numbers as buffers too; they are not stored in the artifact (its integer format is
32-bit and a multiplier is not) but derived here, where the config's ``seed`` reproduces them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007


def splitmix64(value: int) -> int:
    """One step of the SplitMix64 generator: the state advanced by GAMMA, then the output mix (all mod 2^64)."""
    z = (value + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> tuple[int, ...]:
    """The ``ngram_size`` odd hash multipliers of PLE layer ``ple_index`` (module docstring)."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return tuple(2 * (splitmix64((base + _GAMMA * (p + 1)) & _MASK64) % half) + 1 for p in range(ngram_size))


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@lru_cache(maxsize=8)
def primes_from(base: int, count: int) -> tuple[int, ...]:
    """The ``count`` smallest primes >= ``base``, ascending."""
    out: list[int] = []
    n = base
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return tuple(out)


@dataclass(frozen=True)
class NGramHash:
    """One PLE layer's hash constants. Invariant: ``offsets[h] + sizes[h] <= rows`` for every head, and
    ``rows`` is a multiple of the config's divisor."""

    multipliers: tuple[int, ...]   # [ngram_size]
    sizes: tuple[int, ...]         # [G]
    offsets: tuple[int, ...]       # [G]
    rows: int                      # the table's row count (padded)
    heads_per_ngram: int


def ngram_hash(vocab_size: int, ngram_size: int, heads_per_ngram: int, base: int, divisor: int, seed: int,
               ple_index: int) -> NGramHash:
    """The constants of PLE layer ``ple_index`` (module docstring)."""
    g = (ngram_size - 1) * heads_per_ngram
    primes = primes_from(base, (ple_index + 1) * g)
    sizes = primes[ple_index * g:]
    offsets = tuple(sum(sizes[:h]) for h in range(g))
    rows = -(-sum(sizes) // divisor) * divisor
    return NGramHash(multipliers(vocab_size, ngram_size, ple_index, seed), sizes, offsets, rows, heads_per_ngram)


def config_hash(cfg, ple_index: int) -> NGramHash:
    """:func:`ngram_hash` for PLE layer ``ple_index`` of a :class:`~ninfer_qwen4exp.config.Qwen4ExpConfig`."""
    return ngram_hash(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ngram_vocab_size_base,
                      cfg.ngram_vocab_divisor, cfg.seed, ple_index)
