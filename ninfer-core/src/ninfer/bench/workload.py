"""Synthetic benchmark workloads, run through the public :class:`~ninfer.Engine` only.

Prompts are random token ids from a seeded generator (every request its own prompt, so no two share a
prefix); sampling is greedy with every penalty off and ``ignore_eos``, so each request produces exactly
its ``max_tokens`` (checked: a short result is an error, never a silent figure).

- Prefill of L tokens: one request of L prompt tokens and one output token, alone in the engine; its
  time to first token (from submit, as the engine reports it) is the prefill time, L / TTFT the rate.
- Decode at batch B: B requests submitted together, run twice, with ``base`` and ``base + steps``
  output tokens. Each run's *decode span* is the time from the last request's first token to the last
  result (the engine's per-request timings, both from submit); the difference of the two spans is
  ``steps`` decode steps at full batch B (the ragged tail is the same in both runs and cancels), so the
  rate is ``B * steps / (T_long - T_short)``. Spans start after every prefill, so the host-bound prefill of
  B prompts, whose run-to-run spread is of the order of the decode span itself, does not enter the difference
  (a difference of wall times would carry that spread; docs/dev/perf-log.md, corrections).

Warm-up runs (same shapes) come first and are excluded; each figure is the median of ``repeats`` runs.

- Cold start (:meth:`Workload.first_burst`, before every other run): ``max_concurrency`` requests of different
  prompt lengths submitted together right after the engine reported ready, one output token each; their
  slowest TTFT is what the first burst pays for anything start-up left undone (a kernel compiled on first use).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from ninfer.contracts.sampling import SamplingParams
from ninfer.errors import NInferError


class BenchError(NInferError):
    """A benchmark setting cannot be run on this engine, or a run did not do what was asked."""


@dataclass(frozen=True)
class BenchSettings:
    """Invariants (checked by :meth:`validate`): batches in 1..8, lengths >= 1, repeats >= 1,
    ``decode_steps >= 1``, ``decode_base_tokens >= 1``."""

    batches: tuple[int, ...] = (1, 2, 4, 8)
    prefill_lengths: tuple[int, ...] = (1024, 8192, 32768)
    decode_prompt_tokens: int = 128
    decode_base_tokens: int = 8
    decode_steps: int = 64
    repeats: int = 3
    warmup: int = 1
    seed: int = 0

    def validate(self) -> BenchSettings:
        if not self.batches or any(not 1 <= b <= 8 for b in self.batches):
            raise BenchError(f"batches {self.batches} must be non-empty, each in 1..8")
        if any(n < 1 for n in self.prefill_lengths):
            raise BenchError(f"prefill lengths {self.prefill_lengths} must be >= 1")
        for name in ("decode_prompt_tokens", "decode_base_tokens", "decode_steps", "repeats"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise BenchError(f"warmup={self.warmup} must be >= 0")
        return self

    @property
    def decode_context_needed(self) -> int:
        """The longest ledger a decode run reaches."""
        return self.decode_prompt_tokens + self.decode_base_tokens + self.decode_steps


@dataclass(frozen=True)
class PrefillResult:
    tokens: int
    ttft_s: float                 # median
    ttft_samples: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.ttft_s


@dataclass(frozen=True)
class FirstBurst:
    """The first requests after start: their prompt lengths and TTFTs (seconds, from submit)."""

    prompt_tokens: tuple[int, ...]
    ttft_samples: tuple[float, ...]

    @property
    def ttft_max_s(self) -> float:
        return max(self.ttft_samples)


@dataclass(frozen=True)
class DecodeResult:
    """``context_tokens``: the mean KV length a measured step attends over."""

    batch: int
    steps: int
    context_tokens: float
    short_s: float                # medians of the two runs' decode spans (last first token -> last result)
    long_s: float
    ttft_s: float                 # median over the long runs' requests
    long_samples: tuple[float, ...]
    short_samples: tuple[float, ...]

    @property
    def step_s(self) -> float:
        return (self.long_s - self.short_s) / self.steps

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
    """Submit every prompt at once; (the decode span: seconds from the last first token to the last result,
    each request's TTFT)."""
    sampling = _greedy(max_tokens)
    handles = [engine.submit(p, sampling=sampling) for p in prompts]
    results = []
    for h in handles:
        with h:
            results.append(h.result())
    for r in results:
        if r.usage.completion_tokens != max_tokens:
            raise BenchError(f"a benchmark request produced {r.usage.completion_tokens} tokens, not {max_tokens} "
                             f"(finish_reason {r.finish_reason})")
    ttfts = [r.timings.ttft_s for r in results]
    return max(r.timings.total_s for r in results) - max(ttfts), ttfts


class Workload:
    """Runs the settings' workloads on one engine; prompts come from one seeded generator. ``decode=False``:
    only prefills will run, so the decode runs' context is not checked against the engine's."""

    def __init__(self, engine, settings: BenchSettings, progress=None, *, decode: bool = True) -> None:
        self.engine = engine
        self.settings = settings.validate()
        self.rng = random.Random(settings.seed)
        self.progress = progress or (lambda msg: None)
        if decode and max(settings.batches) > engine.options.max_concurrency:
            raise BenchError(f"batch {max(settings.batches)} exceeds the engine's max_concurrency "
                             f"{engine.options.max_concurrency}")
        if decode and settings.decode_context_needed > engine.max_context:
            raise BenchError(f"decode runs reach {settings.decode_context_needed} tokens, over max_context "
                             f"{engine.max_context}")

    def _prompts(self, n: int, length: int) -> list[list[int]]:
        return [random_prompt(self.rng, self.engine.vocab_size, length) for _ in range(n)]

    def first_burst(self) -> FirstBurst:
        """The cold-start burst (module docstring): prompt lengths from their own seeded generator (the other
        runs' prompts stay those of the seed), between 1 and twice the decode prompt, within the context."""
        rng = random.Random(self.settings.seed + 1)
        n = self.engine.options.max_concurrency
        cap = max(1, min(2 * self.settings.decode_prompt_tokens, self.engine.max_context - 1))
        lengths = [rng.randint(1, cap) for _ in range(n)]
        prompts = [random_prompt(rng, self.engine.vocab_size, length) for length in lengths]
        _, ttfts = _run_batch(self.engine, prompts, 1)
        return FirstBurst(prompt_tokens=tuple(lengths), ttft_samples=tuple(ttfts))

    def prefill(self, length: int) -> PrefillResult:
        if length >= self.engine.max_context:
            raise BenchError(f"a prefill of {length} tokens leaves no room for an output token in max_context "
                             f"{self.engine.max_context}")
        s = self.settings
        for _ in range(s.warmup):
            _run_batch(self.engine, self._prompts(1, length), 1)
        samples = []
        for i in range(s.repeats):
            _, ttft = _run_batch(self.engine, self._prompts(1, length), 1)
            samples.append(ttft[0])
            self.progress(f"prefill {length} tokens: run {i + 1}/{s.repeats} ttft {ttft[0] * 1000:.1f} ms")
        return PrefillResult(tokens=length, ttft_s=statistics.median(samples), ttft_samples=tuple(samples))

    def decode(self, batch: int) -> DecodeResult:
        s = self.settings
        short_n, long_n = s.decode_base_tokens, s.decode_base_tokens + s.decode_steps
        for _ in range(s.warmup):
            _run_batch(self.engine, self._prompts(batch, s.decode_prompt_tokens), short_n)
        shorts, longs, ttfts = [], [], []
        for i in range(s.repeats):
            shorts.append(_run_batch(self.engine, self._prompts(batch, s.decode_prompt_tokens), short_n)[0])
            span, ttft = _run_batch(self.engine, self._prompts(batch, s.decode_prompt_tokens), long_n)
            longs.append(span)
            ttfts.extend(ttft)
            self.progress(f"decode B={batch}: run {i + 1}/{s.repeats} {shorts[-1]:.3f} s / {span:.3f} s")
        short_s, long_s = statistics.median(shorts), statistics.median(longs)
        if not long_s > short_s:
            raise BenchError(f"decode B={batch}: {long_n} tokens took {long_s:.4f} s, not more than {short_n} tokens "
                             f"({short_s:.4f} s); raise --decode-steps so the difference is measurable")
        # A measured step emits output token j (j = short_n .. long_n - 1) and attends P + j positions.
        context = s.decode_prompt_tokens + short_n + (s.decode_steps - 1) / 2
        return DecodeResult(batch=batch, steps=s.decode_steps, context_tokens=context, short_s=short_s,
                            long_s=long_s, ttft_s=statistics.median(ttfts), long_samples=tuple(longs),
                            short_samples=tuple(shorts))
