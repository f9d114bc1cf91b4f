"""Synthetic benchmark workloads, run through the public :class:`~ninfer.Engine` only.

Prompts are random token ids from a seeded generator (every request its own prompt, so no two share a
prefix); sampling is greedy with every penalty off and ``ignore_eos``, so each request produces exactly
its ``max_tokens`` (checked: a short result is an error, never a silent figure).

- Prefill of L tokens: one request of L prompt tokens and one output token, alone in the engine; its
  time to first token (from submit, as the engine reports it) is the prefill time, L / TTFT the rate.
- Decode at batch B: B requests submitted together, run twice, with ``base`` and ``base + steps``
  output tokens. Each run's *decode span* is the time from the last request's first token to the last
  result (the engine's per-request timings, both from submit); the difference of the two spans is the time
  of ``steps`` more committed tokens per request at full batch B (the ragged tail is the same in both runs
  and cancels), so the rate is ``B * steps / (T_long - T_short)`` committed tokens per second. Spans start
  after every prefill, so the host-bound prefill of B prompts, whose run-to-run spread is of the order of the
  decode span itself, does not enter the difference (a difference of wall times would carry that spread;
  docs/dev/perf-log.md, corrections).
- Engine steps: each run also counts its *row steps*, the decode steps each request took (its token events
  less the first, which its prefill commits), summed over the batch. Without speculation a step commits one
  token per row, so a run of ``n`` tokens takes ``B * (n - 1)`` row steps; with speculation a verify
  commits 1..k+1. The measured window's engine steps are the difference of the two runs' row steps over B,
  the same differencing as the spans: ``tokens_per_step = steps / engine_steps`` (1 without speculation) and
  one step takes ``(T_long - T_short) / engine_steps``.

Warm-up runs (same shapes) come first and are excluded; each figure is the median of ``repeats`` runs.

- Cold start (:meth:`Workload.first_burst`, before every other run): ``max_concurrency`` requests of different
  prompt lengths submitted together right after the engine reported ready, one output token each; their
  slowest TTFT is what the first burst pays for anything start-up left undone (a kernel compiled on first use).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from ninfer.contracts.events import GenerationDelta
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
    """``steps``: the measured committed tokens per request; ``context_tokens``: the mean KV length a measured
    token is computed over. Row steps: per run, the decode steps of its requests summed (module docstring)."""

    batch: int
    steps: int
    context_tokens: float
    short_s: float                # medians of the two runs' decode spans (last first token -> last result)
    long_s: float
    ttft_s: float                 # median over the long runs' requests
    long_samples: tuple[float, ...]
    short_samples: tuple[float, ...]
    long_row_steps: tuple[int, ...]
    short_row_steps: tuple[int, ...]

    @property
    def engine_steps(self) -> float:
        """Engine decode steps at full batch in the measured window (``steps`` without speculation)."""
        diff = statistics.median(self.long_row_steps) - statistics.median(self.short_row_steps)
        return diff / self.batch

    @property
    def token_s(self) -> float:
        """A request's time per committed token."""
        return (self.long_s - self.short_s) / self.steps

    @property
    def step_s(self) -> float:
        """One engine decode step's time (``token_s`` without speculation)."""
        return (self.long_s - self.short_s) / self.engine_steps

    @property
    def tokens_per_step(self) -> float:
        """Committed tokens per request and engine step (1 without speculation)."""
        return self.steps / self.engine_steps

    @property
    def tokens_per_s(self) -> float:
        """Committed tokens per second, the whole batch."""
        return self.batch / self.token_s


@dataclass(frozen=True)
class RunSample:
    """One batch run: its decode span, each request's TTFT, and its row steps (module docstring)."""

    span_s: float
    ttfts: tuple[float, ...]
    row_steps: int


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run_batch(engine, prompts: list[list[int]], max_tokens: int) -> RunSample:
    """Submit every prompt at once and read every request's events to its end (the decode span: seconds
    from the last first token to the last result)."""
    sampling = _greedy(max_tokens)
    handles = [engine.submit(p, sampling=sampling) for p in prompts]
    results, row_steps = [], 0
    for h in handles:
        with h:
            # One GenerationDelta per engine step that committed tokens of the request; the first is its prefill's.
            row_steps += sum(1 for e in h if isinstance(e, GenerationDelta) and e.token_ids) - 1
            results.append(h.result())
    for r in results:
        if r.usage.completion_tokens != max_tokens:
            raise BenchError(f"a benchmark request produced {r.usage.completion_tokens} tokens, not {max_tokens} "
                             f"(finish_reason {r.finish_reason})")
    ttfts = tuple(r.timings.ttft_s for r in results)
    return RunSample(max(r.timings.total_s for r in results) - max(ttfts), ttfts, row_steps)


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
        sample = _run_batch(self.engine, prompts, 1)
        return FirstBurst(prompt_tokens=tuple(lengths), ttft_samples=sample.ttfts)

    def prefill(self, length: int) -> PrefillResult:
        if length >= self.engine.max_context:
            raise BenchError(f"a prefill of {length} tokens leaves no room for an output token in max_context "
                             f"{self.engine.max_context}")
        s = self.settings
        for _ in range(s.warmup):
            _run_batch(self.engine, self._prompts(1, length), 1)
        samples = []
        for i in range(s.repeats):
            ttft = _run_batch(self.engine, self._prompts(1, length), 1).ttfts[0]
            samples.append(ttft)
            self.progress(f"prefill {length} tokens: run {i + 1}/{s.repeats} ttft {ttft * 1000:.1f} ms")
        return PrefillResult(tokens=length, ttft_s=statistics.median(samples), ttft_samples=tuple(samples))

    def decode(self, batch: int) -> DecodeResult:
        s = self.settings
        short_n, long_n = s.decode_base_tokens, s.decode_base_tokens + s.decode_steps
        for _ in range(s.warmup):
            _run_batch(self.engine, self._prompts(batch, s.decode_prompt_tokens), short_n)
        shorts, longs, ttfts = [], [], []
        for i in range(s.repeats):
            shorts.append(_run_batch(self.engine, self._prompts(batch, s.decode_prompt_tokens), short_n))
            longs.append(_run_batch(self.engine, self._prompts(batch, s.decode_prompt_tokens), long_n))
            ttfts.extend(longs[-1].ttfts)
            self.progress(f"decode B={batch}: run {i + 1}/{s.repeats} {shorts[-1].span_s:.3f} s / "
                          f"{longs[-1].span_s:.3f} s")
        short_s, long_s = statistics.median(r.span_s for r in shorts), statistics.median(r.span_s for r in longs)
        if not long_s > short_s:
            raise BenchError(f"decode B={batch}: {long_n} tokens took {long_s:.4f} s, not more than {short_n} tokens "
                             f"({short_s:.4f} s); raise --decode-steps so the difference is measurable")
        # A measured token j (j = short_n .. long_n - 1) is computed over P + j positions.
        context = s.decode_prompt_tokens + short_n + (s.decode_steps - 1) / 2
        result = DecodeResult(batch=batch, steps=s.decode_steps, context_tokens=context, short_s=short_s,
                              long_s=long_s, ttft_s=statistics.median(ttfts),
                              long_samples=tuple(r.span_s for r in longs),
                              short_samples=tuple(r.span_s for r in shorts),
                              long_row_steps=tuple(r.row_steps for r in longs),
                              short_row_steps=tuple(r.row_steps for r in shorts))
        if not result.engine_steps > 0:
            raise BenchError(f"decode B={batch}: the {long_n}-token runs took no more engine steps than the "
                             f"{short_n}-token runs (speculation); raise --decode-steps so the difference is "
                             f"measurable")
        return result
