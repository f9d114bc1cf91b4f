"""Speculative decoding inside the Qwen3.5 Program: drafting, one verify forward, acceptance, commit.

A Program built with ``ProgramOptions.speculative_tokens = k > 0`` runs every unit through
:meth:`SpeculativeDecoding.run` (a Program built without it never reaches this module). The drafter is a
subclass: :class:`~ninfer_qwen3_5.mtp.decoding.MTPDecoding` (the checkpoint's MTP head) or
:class:`~ninfer_qwen3_5.dflash.decoding.DFlashDecoding` (a DFlash / DFlash2 block drafter). A decode row with
``DecodeRow.drafts = n > 0`` drafts ``n`` tokens and verifies ``[t_last, d_1..d_n]`` as a verify chunk
(:mod:`ninfer_qwen3_5.speculative_state`) in the same one forward as the unit's plain decode rows and prefill
chunks; every such forward also returns what the drafter reads of the target (its *taps*: the final-normed
hidden states for MTP, the outputs of some layers for DFlash), one row per token.

Acceptance: the target's logits at verify position ``i`` are transformed exactly as plain sampling transforms
a decode row's (:mod:`ninfer.program.sampling`: penalties over the ledger extended by ``d_1..d_i``, then the
``sample`` op with the request's seed and step ``step + i``, or ``greedy_tokens`` when every row is greedy),
giving the token ``x_i`` plain decoding would emit there. The row keeps the drafts while ``d_{i+1} == x_i``
and then adds ``x_n`` (:func:`~ninfer.program.speculation.greedy_acceptance` over the tokens ``x``). At
temperature 0 that is the greedy rule; with sampling it is
:func:`~ninfer.program.speculation.rejection_acceptance` with ``q=None`` (a deterministic drafter), its
Gumbel draws being the ``sample`` op's own: a seeded request commits the very tokens plain sampling would. A
drafter that samples its drafts (DFlash2's selector at temperature > 0) hands its proposal distribution q for
such rows, which are accepted by :func:`~ninfer.program.speculation.rejection_acceptance` with that q
(:meth:`SpeculativeDecoding.accept_sampled`): the committed tokens are distributed as plain sampling's.

Constrained rows (:mod:`ninfer.program.draft_masks`): a row whose mask is a ``DraftMaskProvider`` drafts with
its grammar's mask applied at every draft step (the mask after ``d_1..d_{i-1}`` before drafting ``d_i``), and
verify position ``i`` is masked with the mask after ``d_1..d_i`` (before the penalties, as plain sampling
orders them); the row verifies only the drafts the grammar accepts without ending. The provider is only
asked, never advanced: the engine advances it over the committed tokens. A constrained row with any other
mask may not draft (ProgramError). A row asking for logprobs gets, for each committed token, the raw
distribution's logprobs at that token's verify position, as plain sampling reports them.

Commit of a verify row accepting ``a`` tokens: ``computed += a`` and snapshot ``a - 1`` becomes the live
StateImage (``select_snapshot``; ``a = 0`` keeps it, and the row stays decode-ready); the drafter then takes the
accepted inputs (``commit_row``, with the taps of the first ``a`` verify inputs where the drafter keeps them). One
verify may be outstanding at a time (its snapshots are reused by the next).

A unit of verify rows only, each with the full ``k`` drafts, replays a verify CUDA graph when the Program captured
them (:mod:`ninfer_qwen3_5.verify_graphs`); any other unit runs its forward eagerly. A drafter may capture graphs of
its own (:meth:`SpeculativeDecoding.capture_draft_graphs`; the MTP drafter's: :mod:`ninfer_qwen3_5.mtp.draft_graphs`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from ninfer.contracts.program import (
    DecodeRow,
    ExecutionUnit,
    PendingBatch,
    PendingRow,
    ProgramError,
    RowSampling,
    SeqId,
    TokenLogprob,
)
from ninfer.program.batch import ForwardBatch, pack_batch, to_device
from ninfer.program.draft_masks import VerifyMasks, may_verify
from ninfer.program.sampling import draw, mask_rows, penalize, token_logprobs, wants_logprobs
from ninfer.program.speculation import greedy_acceptance

from ninfer_qwen3_5.speculative_state import verify_chunk_rows
from ninfer_qwen3_5.verify_graphs import VerifyGraphs


@dataclass(frozen=True)
class Drafts:
    """A draft call's result: ``tokens[r]`` row r's drafts (host list, ``n_r`` of them); ``q`` (None: none) maps a
    row index to its proposal distribution ``[n_r, V]`` fp32 when the drafter *sampled* that row's drafts (row
    ``i`` of it: the distribution ``d_{i+1}`` was drawn from); a row without one was drafted deterministically."""

    tokens: list[list[int]]
    q: Mapping[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class Part:
    """Positions ``[start, start + length)`` of ``seq`` that a forward computed outside a verify (a plain decode
    row or a prefill chunk): committed inputs, whose taps are ``taps`` ``[length, ...]``."""

    seq: SeqId
    start: int
    length: int
    taps: torch.Tensor
    chunk: bool


@dataclass(frozen=True)
class _Verify:
    """A verify row awaiting commit: the taps of its inputs ``[n + 1, ...]`` (None: the drafter keeps none,
    :attr:`SpeculativeDecoding.keeps_verify_taps`) and ``computed`` when it ran."""

    taps: torch.Tensor | None
    start: int


class SpeculativeDecoding(ABC):
    """The speculative side of a Qwen3.5 Program (``program``) verifying up to ``k`` drafts per row. Subclasses
    are the drafters: they implement the hooks below (module docstring for the rules this class keeps)."""

    #: Whether :meth:`commit_row` reads the verify rows' taps (else they are not copied and it gets None).
    keeps_verify_taps = True

    def __init__(self, program, k: int) -> None:
        self.p, self.k = program, k
        self._verify: dict[SeqId, _Verify] = {}
        self._verify_batch: int | None = None
        #: The verify CUDA graphs (:mod:`ninfer_qwen3_5.verify_graphs`), set by the Program when it captures them.
        self.graphs: VerifyGraphs | None = None
        #: Monotone counts: verify rows run, drafts they verified, drafts accepted (by the acceptance rule).
        self.verified = self.drafted = self.accepted = 0

    # -- drafter hooks ---------------------------------------------------------------------------
    @abstractmethod
    def model_forward(self, packed, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits of the logit rows, taps of every token)`` of one target forward."""

    @abstractmethod
    def may_draft(self, seq: SeqId) -> bool:
        """Whether ``seq`` (decode-ready) can draft now; a row that cannot decodes plainly this step."""

    def touch(self, seq: SeqId) -> None:  # noqa: B027 (optional hook)
        """``seq`` is a member of the unit about to run (create its bookkeeping if it has none; default: none kept)."""

    @abstractmethod
    def draft(self, verify: list[tuple[DecodeRow, int]], masks: Mapping[SeqId, VerifyMasks]) -> Drafts:
        """Each verify row's drafts; a constrained row's follow its grammar (``masks`` fill as they are drafted)."""

    @abstractmethod
    def absorb(self, parts: list[Part]) -> None:
        """The taps of the positions a forward just computed outside verify rows (their ``computed`` advanced)."""

    @abstractmethod
    def commit_row(self, seq: SeqId, start: int, taps: torch.Tensor | None, accepted: int) -> None:
        """A verify row of ``seq`` run at ``computed = start`` committed ``accepted`` inputs; ``taps`` are those
        inputs' (``accepted`` rows; None unless :attr:`keeps_verify_taps`). Called after ``computed`` advanced."""

    def forget_seq(self, seq: SeqId) -> None:  # noqa: B027 (optional hook)
        """Drop the drafter's bookkeeping of ``seq`` (default: none kept)."""

    def capture_draft_graphs(self, max_rows: int, max_pages: int) -> None:  # noqa: B027 (optional hook)
        """Capture the drafter's own CUDA graphs for up to ``max_rows`` drafting rows, if it has any (default: none);
        called with the verify graphs' capture, while no sequence exists."""

    def close_draft_graphs(self) -> None:  # noqa: B027 (optional hook)
        """Drop what :meth:`capture_draft_graphs` captured (default: nothing)."""

    def accept_sampled(self, processed: torch.Tensor, rows, ns: list[int], starts: list[int], drafts: Drafts,
                       num: list[int]) -> dict[int, list[int]]:
        """The committed tokens of the verify rows whose drafts were sampled (``drafts.q``), by rejection
        sampling against their q: ``processed`` every verify position's masked and penalised logits (``rows``
        order), row r's ``ns[r] + 1`` positions from ``starts[r]``, ``num[r]`` drafts verified. Only a drafter
        that samples implements it."""
        raise ProgramError(f"{type(self).__name__} drafts deterministically: it has no sampled rows to accept")

    # -- run -------------------------------------------------------------------------------------
    def run(self, unit: ExecutionUnit) -> PendingBatch:
        p = self.p
        members = p._members(unit)
        if len(set(members)) != len(members):
            raise ProgramError(f"a sequence appears twice in one execution unit: {members}")
        verify: list[tuple[DecodeRow, int]] = []
        plain: list[DecodeRow] = []
        for row in unit.decode:
            n = row.drafts
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.k:
                raise ProgramError(f"decode row of sequence {row.seq} asks for {n!r} drafts; this Program "
                                   f"verifies 0..{self.k} (ProgramOptions.speculative_tokens)")
            if n == 0:
                plain.append(row)
                continue
            if not may_verify(row.sampling):
                raise ProgramError(f"decode row of sequence {row.seq}: a constrained row whose mask is not a "
                                   f"DraftMaskProvider cannot draft (drafts must be 0)")
            s = p._ready(row.seq, "decode")
            if s.computed != len(s.ledger) - 1:
                raise ProgramError(f"decode sequence {row.seq} is not decode-ready "
                                   f"(computed {s.computed}, ledger {len(s.ledger)})")
            self.touch(row.seq)
            if not self.may_draft(row.seq):
                plain.append(DecodeRow(row.seq, row.sampling))   # nothing to draft from: decode plainly
                continue
            if not p.kv.writable(row.seq, s.computed, s.computed + n + 1):
                raise ProgramError(f"speculative sequence {row.seq} has no KV reserved for {n + 1} tokens "
                                   f"(or a page there is shared)")
            verify.append((row, n))
        if verify and self._verify_batch is not None:
            raise ProgramError(f"pending batch {self._verify_batch} still holds verify rows: commit or abort it "
                               f"before the next speculative step")
        rest = ExecutionUnit(decode=tuple(DecodeRow(r.seq, r.sampling) for r in plain), chunks=unit.chunks)
        batch, sampling = p._prepare(rest) if (rest.decode or rest.chunks) else (None, [])
        for sid in members:
            self.touch(sid)
        try:
            with torch.inference_mode():
                return self._execute(unit, batch, sampling, verify)
        except Exception:
            p._damage(members)
            raise

    def _execute(self, unit: ExecutionUnit, batch: ForwardBatch | None, sampling, verify) -> PendingBatch:
        p = self.p
        # Constrained verify rows: mask 0 now, the others as the (masked) drafter drafts.
        masks = {row.seq: VerifyMasks(row.sampling.mask, n, p.vocab_size)
                 for row, n in verify if row.sampling.mask is not None}
        drafts = self.draft(verify, masks) if verify else Drafts([])
        seqs = [row.seq for row, _ in verify]
        snaps = p.snapshots.assign([p.state_slot(sid) for sid in seqs], [n + 1 for _, n in verify])
        chunks = tuple(verify_chunk_rows(p, row.seq, p.computed(row.seq), [p._seqs[row.seq].ledger[-1], *d], sn)
                       for (row, _), d, sn in zip(verify, drafts.tokens, snaps, strict=True))
        fb = ForwardBatch(decode=batch.decode if batch is not None else None,
                          chunks=(batch.chunks if batch is not None else ()) + chunks)
        if self._graphed(batch, verify):
            logits, taps = self.graphs.run(chunks)
        else:
            packed = pack_batch(fb, p.device)
            logits, taps = self.model_forward(packed, p.step_context(packed))
        m = len(sampling)
        tokens, logprobs = p._sample(logits[:m], sampling) if m else ([], [])
        committed, committed_lps = self._accept(logits[m:], verify, drafts, masks) if verify else ([], [])
        # Every forward succeeded: advance the plain rows, hand the drafter their taps.
        at, parts = 0, []
        for sid in (fb.decode.seqs if fb.decode is not None else ()):
            parts.append(Part(sid, p._seqs[sid].computed, 1, taps[at:at + 1], False))
            p._seqs[sid].computed += 1
            at += 1
        for c in fb.chunks:
            if c.verify:
                # A copy: a view would keep the whole forward's taps alive until the commit.
                kept = taps[at:at + c.num_tokens].clone() if self.keeps_verify_taps else None
                self._verify[c.seq] = _Verify(kept, c.start)
            else:
                parts.append(Part(c.seq, c.start, c.num_tokens, taps[at:at + c.num_tokens], True))
                p._seqs[c.seq].computed += c.num_tokens
            at += c.num_tokens
        self.absorb(parts)
        out = {sid: (tok, lp) for (sid, _), tok, lp in zip(sampling, tokens, logprobs, strict=True)}
        for (row, _), toks, lps in zip(verify, committed, committed_lps, strict=True):
            out[row.seq] = (toks, lps)
        # The drafts each row verified: a constrained row's stop where its grammar rejects one or ends.
        verified = {row.seq: masks[row.seq].valid if row.seq in masks else n for row, n in verify}
        decoding = {r.seq for r in unit.decode}
        order = [r.seq for r in unit.decode] + [sid for sid, _ in sampling if sid not in decoding]
        rows = []
        for sid in order:
            toks, lp = out[sid]
            if isinstance(toks, int):
                rows.append(PendingRow(seq=sid, tokens=(toks,), logprobs=None if lp is None else (lp,)))
            else:
                rows.append(PendingRow(seq=sid, tokens=tuple(toks), logprobs=lp, drafted=verified[sid]))
        pending = p._pending_of(rows)
        if verify:
            self._verify_batch = pending.batch_id
        return pending

    def _graphed(self, batch: ForwardBatch | None, verify) -> bool:
        """Whether this unit's forward is a verify graph's: only verify rows, each of the full ``k`` drafts."""
        return (self.graphs is not None and batch is None and bool(verify) and all(n == self.k for _, n in verify)
                and self.graphs.has(len(verify)))

    def _accept(self, logits: torch.Tensor, verify, drafts: Drafts, masks: Mapping[SeqId, VerifyMasks]
                ) -> tuple[list[list[int]], list[tuple[TokenLogprob, ...] | None]]:
        """The committed tokens of each verify row (module docstring: plain sampling's token at each
        position, kept while the drafts agree; a sampled row by rejection against its q), and their logprobs
        for a row that asks for them."""
        p = self.p
        rows: list[tuple[tuple[SeqId, int], RowSampling]] = []
        index, words = [], []
        for row, n in verify:
            rs = row.sampling
            if row.seq in masks:
                index.extend(range(len(rows), len(rows) + n + 1))
                words.append(masks[row.seq].words)
            rows.extend(((row.seq, i), RowSampling(rs.params, rs.seed, rs.step + i)) for i in range(n + 1))
        drafted = {row.seq: d for (row, _), d in zip(verify, drafts.tokens, strict=True)}

        def history(key):   # the ledger position i would see: the committed tokens, then d_1..d_i
            sid, i = key
            s = p._seqs[sid]
            return list(s.ledger) + drafted[sid][:i], s.prompt_length

        raw = logits.float()
        masked = mask_rows(raw, index, torch.cat(words)) if words else raw
        processed = penalize(masked, rows, history, p.ops, p.vocab_size)
        x = draw(processed, rows, p.ops, p.vocab_size, lambda _: None)
        width = max(n for _, n in verify)
        xs = torch.zeros((len(verify), width + 1), dtype=torch.int64, device=x.device)
        # A constrained row verifies only the drafts its grammar accepts without ending (draft_masks).
        num = [masks[row.seq].valid if row.seq in masks else n for row, n in verify]
        at = 0
        for r, (_, n) in enumerate(verify):
            xs[r, :n + 1] = x[at:at + n + 1]
            at += n + 1
        # The drafts and counts in one pinned non-blocking copy (a pageable one waits for the whole stream).
        host = [t for d in drafts.tokens for t in (*d, *[0] * (width - len(d)))] + num
        flat = to_device(host, torch.int64, x.device)
        dr = flat[:len(verify) * width].view(len(verify), width)
        acc = greedy_acceptance(dr, xs, flat[len(verify) * width:])
        committed = acc.to_host()
        if drafts.q:
            starts, at = [], 0
            for _, n in verify:
                starts.append(at)
                at += n + 1
            sampled = self.accept_sampled(processed, rows, [n for _, n in verify], starts, drafts, num)
            for r, toks in sampled.items():
                committed[r] = toks
        self.verified += len(verify)
        self.drafted += sum(num)
        self.accepted += sum(len(t) - 1 for t in committed)
        return committed, self._logprobs(raw, rows, verify, committed)

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows, verify, committed: list[list[int]]
                  ) -> list[tuple[TokenLogprob, ...] | None]:
        """Each verify row's logprobs of its committed tokens (None: the row does not ask): plain sampling's,
        the raw distribution at each committed token's position."""
        want, tokens, starts = [], [0] * len(rows), []
        at = 0
        for (row, n), toks in zip(verify, committed, strict=True):
            starts.append(at)
            if wants_logprobs(row.sampling):
                want.extend(range(at, at + len(toks)))
                tokens[at:at + len(toks)] = toks
            at += n + 1
        if not want:
            return [None] * len(verify)
        lp = torch.log_softmax(raw[want], dim=-1).cpu()
        per_position = token_logprobs(lp, want, rows, tokens)
        return [tuple(per_position[a:a + len(toks)]) if wants_logprobs(row.sampling) else None
                for (row, _), toks, a in zip(verify, committed, starts, strict=True)]

    # -- commit ----------------------------------------------------------------------------------
    def commit_inputs(self, pending: PendingBatch, accepted: Mapping[SeqId, int]) -> None:
        """Before the ledgers grow: each verify row of ``pending`` takes its accepted inputs (module docstring)."""
        if self._verify_batch != pending.batch_id:
            return
        p = self.p
        for r in pending.rows:
            v = self._verify.pop(r.seq, None)
            if v is None:
                continue
            a = accepted[r.seq]
            p.select_snapshot(p.state_slot(r.seq), a)
            p._seqs[r.seq].computed += a
            if a:
                with torch.inference_mode():
                    self.commit_row(r.seq, v.start, None if v.taps is None else v.taps[:a], a)
        self._verify_batch = None

    def abort(self, pending: PendingBatch) -> None:
        """Drop ``pending``'s verify rows (their live state was never written; the drafter's bookkeeping stays)."""
        if self._verify_batch != pending.batch_id:
            return
        for r in pending.rows:
            self._verify.pop(r.seq, None)
        self._verify_batch = None

    def forget(self, seq: SeqId) -> None:
        """Drop ``seq``'s speculative bookkeeping (released, paused, or advanced outside :meth:`run`)."""
        self._verify.pop(seq, None)
        self.forget_seq(seq)
