"""Start-up warm-up: a Program's own step paths run over synthetic sequences before the engine serves.

Why: Triton compiles a kernel the first time it is launched with a new *variant*: a new combination of
constexpr arguments, of integer arguments that are 1 or divisible by 16 (unless the kernel marks them
``do_not_specialize``) and of pointer arguments on or off a 16-byte boundary (unless marked
``do_not_specialize_on_alignment``). Each compilation costs tens to hundreds of milliseconds, so shapes
start-up never ran make the first burst after start seconds slower than the next. Decode graph capture
compiles the decode-only step for B = 1..max_batch; this runs what remains (:func:`run_warm_up`).

What still selects a variant once the kernels mark their shape-following integers and metadata pointers
(each kernel module's docstring; the rest are fixed per model: feature dims, strides, dtypes):

- the tokens N of one model call: the decode GEMV's row tile (N <= 8), MoE's decode GEMV and grouped
  tiles (N times the experts per token against the expert count; classes are doubling intervals);
- the sampling rows R of one call: the LM head's GEMV row tile;
- the chunks C of one call: the prefill attention's row block (C rounded up to a power of two);
- decode rows beside chunks and their page-table width (one KV split for a short context, several for a long
  one);
- the sampler's path: greedy (eager, or precomputed by a decode graph), the filtered Gumbel draw,
  penalties, allowed-token masks, logprobs; lookahead adoption; speculative verify rows; checkpoints.

The plan (every unit within :class:`~ninfer.contracts.program.WarmupLimits`, as the scheduler could
make it): (1) one-chunk prefills of T tokens for T = 1..16, a few odd sizes, the powers of two and the
largest chunk; (2) units of C = 2..max_rows chunks, and chunks that do not sample; (3) decode rows beside
a chunk, B = 1..max_rows - 1; (4) decode-only units B = 1..max_rows, twice in a row (a lookahead is
adopted), then with masks and penalties; (5) a long-context decode row alone, beside a chunk and beside
short rows; (6) speculative verify rows; (7) a checkpoint taken, opened from and dropped. Sampling
parameters rotate over the rows. Units run through the Program contract (open, reserve, run, commit,
release), so they take the serving path itself.

Invariants: see :meth:`~ninfer.contracts.program.Program.warm_up`; the caller
(:meth:`~ninfer.program.base.SequenceProgram.warm_up`) checks that nothing is open before and restores
the lookahead counters after.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ninfer.contracts.program import (
    CheckpointProgram,
    DecodeRow,
    ExecutionUnit,
    PrefillChunk,
    Program,
    RowSampling,
    SeqId,
    WarmupLimits,
    WarmupSummary,
)
from ninfer.contracts.sampling import SamplingParams

#: Every token total up to this one is run (the GEMV row tiles and MoE decode tiles select on small N).
SMALL_TOKENS = 16
#: Odd totals beyond it (neither 1 nor a multiple of 16), and each size's neighbours are powers of two.
ODD_TOKENS = (17, 31, 33, 100, 257)
#: The long decode context: past the decode attention's one-split form (64 positions) by several pages.
LONG_CONTEXT = 320
_SEED = 0x5EED
_UNLIMITED = 1 << 30   # max_tokens of warm-up rows: none ever ends on its budget


class _EvenTokens:
    """An allowed-token mask (constrained decoding) that allows the even token ids."""

    def fill_bitmask(self, words: torch.Tensor) -> None:
        words.fill_(0x55555555)


_GREEDY = SamplingParams(temperature=0.0, max_tokens=_UNLIMITED)
_SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, max_tokens=_UNLIMITED)
_PENALIZED = SamplingParams(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2,
                            max_tokens=_UNLIMITED)
_LOGPROBS = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, max_tokens=_UNLIMITED)
_MASK = _EvenTokens()
#: (params, masked). The first three are lookahead-eligible (no mask, no penalties); 0, 1 and 3 may speculate (no
#: mask, no logprobs).
KINDS: tuple[tuple[SamplingParams, bool], ...] = (
    (_GREEDY, False), (_SAMPLED, False), (_LOGPROBS, False), (_PENALIZED, False), (_GREEDY, True), (_SAMPLED, True))
_ELIGIBLE = 3
_MASKED_OR_PENALIZED = (3, 4, 5)


def prefill_sizes(limit: int) -> list[int]:
    """The one-chunk prefill sizes of plan step (1), at most ``limit`` tokens each."""
    sizes = set(range(1, SMALL_TOKENS + 1)) | set(ODD_TOKENS) | {limit}
    p = 32
    while p <= limit:
        sizes.add(p)
        p *= 2
    return sorted(n for n in sizes if n <= limit)


class _Runner:
    """Opens synthetic sequences, runs units of them through the contract and releases them."""

    def __init__(self, program: Program, limits: WarmupLimits) -> None:
        self.program = program
        self.limits = limits
        self.open_seqs: list[SeqId] = []
        self.sampled: dict[SeqId, int] = {}
        self.units = self.tokens = self.skipped = 0
        self._salt = 0

    def open(self, n: int) -> SeqId | None:
        """A new sequence of ``n`` prompt tokens; None (counted as skipped) when no slot or no room is left."""
        p = self.program
        if not 1 <= n < p.max_context or p.capacity().free_state_slots < 1:
            self.skipped += 1
            return None
        self._salt += 1
        seq = p.open_sequence([(self._salt * 7919 + i * 104729) % p.vocab_size for i in range(n)])
        self.open_seqs.append(seq)
        self.sampled[seq] = 0
        return seq

    def release(self, *seqs: SeqId | None) -> None:
        for seq in seqs:
            if seq in self.open_seqs:
                self.open_seqs.remove(seq)
                self.program.release(seq)

    def release_all(self) -> None:
        self.release(*list(self.open_seqs))

    def _sampling(self, seq: SeqId, kind: int) -> RowSampling:
        params, masked = KINDS[kind % len(KINDS)]
        return RowSampling(params, seed=_SEED + seq, step=self.sampled[seq], mask=_MASK if masked else None)

    def run(self, decode: Sequence[tuple[SeqId, int, int]] = (), chunks: Sequence[tuple[SeqId, int, int]] = ()
            ) -> bool:
        """One unit: decode rows ``(seq, kind, drafts)`` (a row whose tokens would pass max_context is left
        out) and chunks ``(seq, tokens, kind)``; every produced token is committed. False (skipped) when
        its pages cannot be reserved or nothing is left to run."""
        p = self.program
        decode = [(s, k, d) for s, k, d in decode if s is not None and p.ledger_length(s) + d + 1 <= p.max_context]
        chunks = [(s, n, k) for s, n, k in chunks if s is not None]
        if not decode and not chunks:
            self.skipped += 1
            return False
        demands = {s: d + 1 for s, _, d in decode} | {s: n for s, n, _ in chunks}
        if not all(p.reserve_units(demands).values()):
            self.skipped += 1
            return False
        rows = tuple(DecodeRow(s, self._sampling(s, k), d) for s, k, d in decode)
        parts = tuple(PrefillChunk(s, n, self._sampling(s, k) if p.computed(s) + n == p.ledger_length(s) else None)
                      for s, n, k in chunks)
        pending = p.run(ExecutionUnit(decode=rows, chunks=parts))
        p.commit(pending, {r.seq: len(r.tokens) for r in pending.rows})
        for r in pending.rows:
            self.sampled[r.seq] += len(r.tokens)
        self.units += 1
        self.tokens += sum(demands.values())
        return True

    def adopt(self, seq: SeqId) -> SeqId:
        """Track a sequence opened elsewhere (from a checkpoint), so it is released with the others."""
        self.open_seqs.append(seq)
        self.sampled[seq] = 0
        return seq

    def prefill(self, seq: SeqId | None, kind: int = 0) -> SeqId | None:
        """``seq`` made decode-ready: the rest of its prompt in chunks of at most the prefill chunk, the last
        one sampling. None (``seq`` released) when a chunk cannot be reserved."""
        p = self.program
        while seq is not None and self.sampled[seq] == 0:
            n = min(self.limits.prefill_chunk, p.ledger_length(seq) - p.computed(seq))
            if not self.run(chunks=[(seq, n, kind)]):
                self.release(seq)
                return None
        return seq

    def ready(self, context: int, kind: int = 0) -> SeqId | None:
        """A decode-ready sequence whose state covers ``context`` prompt tokens."""
        return self.prefill(self.open(context), kind)


def run_warm_up(program: Program, limits: WarmupLimits) -> WarmupSummary:
    """Run the plan of the module docstring on ``program`` (no sequence open) and release everything it
    opened, also when a unit fails (the failure is raised)."""
    started = time.perf_counter()
    r = _Runner(program, limits)
    try:
        _plan(r, program, limits)
    finally:
        r.release_all()
    if program.device.type == "cuda":
        torch.cuda.synchronize(program.device)
    return WarmupSummary(units=r.units, tokens=r.tokens, skipped=r.skipped, seconds=time.perf_counter() - started)


def _plan(r: _Runner, program: Program, limits: WarmupLimits) -> None:
    rows = max(1, min(limits.max_rows, program.capacity().free_state_slots))
    chunk, k = limits.prefill_chunk, limits.speculative_tokens
    room = program.max_context - 1     # the longest prompt that leaves room for its first output token

    # (1) one chunk of T tokens, sampling.
    for i, t in enumerate(prefill_sizes(min(chunk, room))):
        seq = r.open(t)
        r.run(chunks=[(seq, t, i)])
        r.release(seq)

    # (2) C = 2..rows chunks that all sample; then chunks that stop short of their prompt's end: no sampling
    # row with one chunk and with two, one of two chunks sampling.
    for c in range(2, rows + 1):
        lens = [1 + j % 3 for j in range(c)]
        if sum(lens) <= chunk:
            seqs = [r.open(n) for n in lens]
            r.run(chunks=[(s, n, c + j) for j, (s, n) in enumerate(zip(seqs, lens, strict=True))])
            r.release(*seqs)
    if chunk >= 6 and room >= 8:
        a, b = r.open(8), r.open(8) if rows >= 2 else None
        r.run(chunks=[(a, 2, 0)])
        r.run(chunks=[(a, 2, 0), (b, 2, 1)])
        r.run(chunks=[(a, 4, 2), (b, 2, 3)])
        r.release(a, b)

    # (3) B = 1..rows-1 short decode rows beside one chunk (the chunk budget is the step's, less the rows).
    pool = [r.ready(1 + j % 2, j) for j in range(rows - 1)]
    for b in range(1, rows):
        budget = max(1, min(chunk, limits.step_tokens - b))
        seq = r.open(min(budget, 1 + b % 3))
        if seq is not None:
            r.run(decode=[(s, b + j, 0) for j, s in enumerate(pool[:b])],
                  chunks=[(seq, r.program.ledger_length(seq), b)])
        r.release(seq)

    # (4) decode-only B = 1..rows: lookahead-eligible rows twice (the second adopts the first's lookahead),
    # then masked and penalised ones.
    pool.append(r.ready(2, rows))
    for b in range(1, rows + 1):
        eligible = [(s, (b + j) % _ELIGIBLE, 0) for j, s in enumerate(pool[:b])]
        r.run(decode=eligible)
        r.run(decode=eligible)
        r.run(decode=[(s, _MASKED_OR_PENALIZED[(b + j) % 3], 0) for j, s in enumerate(pool[:b])])

    # (5) a long context: alone, beside a chunk, beside the short rows (two of them make room for it and the chunk).
    keep = max(0, len(pool) - 2)
    r.release(*pool[keep:])
    pool = pool[:keep]
    long_seq = r.ready(max(2, min(LONG_CONTEXT, room - 64 - 16 * k)))
    if long_seq is not None:
        r.run(decode=[(long_seq, 0, 0)])
        r.run(decode=[(long_seq, 1, 0)])
        if rows >= 2:
            seq = r.open(min(2, max(1, min(chunk, limits.step_tokens - 1))))
            r.run(decode=[(long_seq, 3, 0)], chunks=[(seq, 1, 0)])
            r.release(seq)
        r.run(decode=[(s, j, 0) for j, s in enumerate([long_seq, *pool])])
        pool = [long_seq, *pool]

    # (6) speculative verify rows (no mask, no logprobs: the scheduler's rule), alone and beside a chunk.
    if k:
        for b in range(1, len(pool) + 1):
            r.run(decode=[(s, (0, 1, 3)[j % 3], k) for j, s in enumerate(pool[:b])])
        if rows >= 2 and pool:
            seq = r.open(2)
            r.run(decode=[(pool[0], 0, k)], chunks=[(seq, 1, 1)])
            r.release(seq)

    # (7) a checkpoint taken from a sequence and opened from (the child's first token lands in the shared last
    # page, which is copied first), then dropped.
    r.release(*pool)
    if isinstance(program, CheckpointProgram) and program.checkpoint_usage().free_slots >= 1 and rows >= 2:
        seq = r.ready(min(room - 8, program.page_size + 3))
        handle = program.capture_checkpoint(seq) if seq is not None else None
        if handle is not None:
            try:
                child = r.adopt(program.open_sequence_from(handle, (*handle.tokens, 1, 2)))
                r.prefill(child)
                r.release(child)
            finally:
                program.drop_checkpoint(handle)
        r.release(seq)
