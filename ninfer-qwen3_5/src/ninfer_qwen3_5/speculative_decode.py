"""MTP speculative decoding inside the Qwen3.5 Program: drafting, one verify forward, acceptance, commit.

A Program built with ``ProgramOptions.speculative_tokens = k > 0`` runs every unit through
:meth:`MTPDecoding.run` (a Program built without it never reaches this module). A decode row with
``DecodeRow.drafts = n > 0`` drafts ``n`` tokens with the MTP head (:mod:`ninfer_qwen3_5.mtp`, greedy) and
verifies ``[t_last, d_1..d_n]`` as a verify chunk (:mod:`ninfer_qwen3_5.speculative_state`) in the same one
forward as the unit's plain decode rows and prefill chunks; every call returns the target's final-normed
hidden states, which feed the MTP head.

Acceptance: the target's logits at verify position ``i`` are transformed exactly as plain sampling transforms
a decode row's (:mod:`ninfer.program.sampling`: penalties over the ledger extended by ``d_1..d_i``, then the
``sample`` op with the request's seed and step ``step + i``, or ``greedy_tokens`` when every row is greedy),
giving the token ``x_i`` plain decoding would emit there. The row keeps the drafts while ``d_{i+1} == x_i``
and then adds ``x_n`` (:func:`~ninfer.program.speculation.greedy_acceptance` over the tokens ``x``). At
temperature 0 that is the greedy rule; with sampling it is
:func:`~ninfer.program.speculation.rejection_acceptance` with ``q=None`` (a deterministic drafter), its
Gumbel draws being the ``sample`` op's own: a seeded request commits the very tokens plain sampling would.

Constrained rows (:mod:`ninfer.program.draft_masks`): a row whose mask is a ``DraftMaskProvider`` drafts with
its grammar's mask applied at every draft step (the mask after ``d_1..d_{i-1}`` before drafting ``d_i``), and
verify position ``i`` is masked with the mask after ``d_1..d_i`` (before the penalties, as plain sampling
orders them); the row verifies only the drafts the grammar accepts without ending. The provider is only
asked, never advanced: the engine advances it over the committed tokens. A constrained row with any other
mask may not draft (ProgramError). A row asking for logprobs gets, for each committed token, the raw
distribution's logprobs at that token's verify position, as plain sampling reports them.

MTP bookkeeping, per sequence (:class:`Frontier`): ``done``, the MTP pool's final positions ``[0, done)``,
and ``hidden``, the target's hidden states of positions ``[done, computed)`` not yet fed to the MTP layer.
Invariant: ``done <= computed``, and the MTP K/V of position ``t < done`` was computed from the target's
hidden state at ``t`` and the committed token ``x_{t+1}`` (a sequence opened from a checkpoint starts at
``done = computed``: the checkpoint's MTP K/V below it are whatever its origin wrote, which only changes
how many drafts are accepted, never which tokens are committed).

- A prefill chunk appends its positions' hidden states, then the MTP layer runs at once over every
  position whose next token is in the ledger (all of a non-final chunk; all but the last of a final one).
- A plain decode row appends its one hidden state (its next token is still provisional).
- A drafting row first feeds the MTP layer positions ``[done, computed)`` (their next tokens are all in the
  ledger now), whose last output drafts ``d_1``; it needs ``done < computed`` (a row without a pending hidden
  state, right after a checkpoint open, decodes plainly that step). Its frontier is settled at commit: with
  ``a >= 1`` accepted tokens, ``done = computed_before`` and ``hidden`` = the verify's hidden states of its
  first ``a`` inputs (``t_last, d_1..d_{a-1}``, the committed ones); with ``a = 0`` (or an abort) it is left
  as it was, so the next draft recomputes the same positions. The MTP K/V past ``done`` written by a draft
  are provisional and are overwritten before anything reads them.
- The MTP pool shares the target's page tables, so MTP K/V of a position below ``computed`` may be written
  into a page a checkpoint shares; the target's pools are never written there, and the MTP entries only move
  the acceptance rate of a sequence later opened from that checkpoint, never its tokens.

Commit of a verify row accepting ``a`` tokens: ``computed += a`` and snapshot ``a - 1`` becomes the live
StateImage (``select_snapshot``; ``a = 0`` keeps it, and the row stays decode-ready). One verify may be
outstanding at a time (its snapshots are reused by the next).
"""

from __future__ import annotations

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
from ninfer.program.batch import ForwardBatch, pack_batch
from ninfer.program.draft_masks import MaskedDrafting, VerifyMasks, may_verify
from ninfer.program.sampling import draw, mask_rows, penalize, token_logprobs, wants_logprobs
from ninfer.program.speculation import greedy_acceptance

from ninfer_qwen3_5.mtp import DraftRow, Qwen35MTPHead, mtp_step_context
from ninfer_qwen3_5.speculative_state import verify_chunk_rows


@dataclass
class Frontier:
    """A sequence's MTP progress (module docstring): MTP positions ``[0, done)`` are final; ``hidden``
    ``[computed - done, H]`` holds the target's hidden states of positions ``[done, computed)`` (None: none)."""

    done: int
    hidden: torch.Tensor | None = None

    def pending(self) -> int:
        return 0 if self.hidden is None else int(self.hidden.shape[0])

    def append(self, h: torch.Tensor) -> None:
        # Copies, never views: a view of one forward's [N, H] hidden states would keep all of it alive.
        self.hidden = h.clone() if self.hidden is None else torch.cat((self.hidden, h))

    def consume(self, n: int) -> None:
        self.done += n
        self.hidden = None if n >= self.pending() else self.hidden[n:].clone()


@dataclass(frozen=True)
class _Verify:
    """A verify row awaiting commit: the hidden states of its inputs ``[n + 1, H]`` and ``computed`` when it ran."""

    hidden: torch.Tensor
    start: int


class MTPDecoding:
    """The speculative side of a Qwen3.5 Program (``program``) drafting up to ``k`` tokens per row with
    ``head``. See the module docstring for the rules it keeps."""

    def __init__(self, program, head: Qwen35MTPHead, k: int) -> None:
        self.p, self.head, self.k = program, head, k
        self.frontiers: dict[SeqId, Frontier] = {}
        self._verify: dict[SeqId, _Verify] = {}
        self._verify_batch: int | None = None
        #: Monotone counts: verify rows run, drafts they verified, drafts accepted (by the acceptance rule).
        self.verified = self.drafted = self.accepted = 0

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
            if self._frontier(row.seq).pending() == 0:
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
            self._frontier(sid)
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
        drafts = self._draft(verify, masks)
        seqs = [row.seq for row, _ in verify]
        snaps = p.snapshots.assign([p.state_slot(sid) for sid in seqs], [n + 1 for _, n in verify])
        chunks = tuple(verify_chunk_rows(p, row.seq, p.computed(row.seq), [p._seqs[row.seq].ledger[-1], *d], sn)
                       for (row, _), d, sn in zip(verify, drafts, snaps, strict=True))
        fb = ForwardBatch(decode=batch.decode if batch is not None else None,
                          chunks=(batch.chunks if batch is not None else ()) + chunks)
        packed = pack_batch(fb, p.device)
        logits, hidden = p.model.forward(packed.tokens, p.step_context(packed), packed.logit_rows,
                                         return_hidden="all")
        m = len(sampling)
        tokens, logprobs = p._sample(logits[:m], sampling) if m else ([], [])
        committed, committed_lps = self._accept(logits[m:], verify, drafts, masks) if verify else ([], [])
        # Every forward succeeded: advance the plain rows, keep the hidden states.
        at = 0
        for sid in (fb.decode.seqs if fb.decode is not None else ()):
            p._seqs[sid].computed += 1
            self.frontiers[sid].append(hidden[at:at + 1])
            at += 1
        caught_up = []
        for c in fb.chunks:
            if c.verify:
                self._verify[c.seq] = _Verify(hidden[at:at + c.num_tokens], c.start)
            else:
                p._seqs[c.seq].computed += c.num_tokens
                self.frontiers[c.seq].append(hidden[at:at + c.num_tokens])
                caught_up.append(c.seq)
            at += c.num_tokens
        self._catch_up(caught_up)
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

    def _draft(self, verify: list[tuple[DecodeRow, int]], masks: Mapping[SeqId, VerifyMasks]) -> list[list[int]]:
        """Each verify row's drafts (host lists), one MTP draft call per distinct draft count; a constrained
        row's drafts follow its grammar (``masks`` fills as they are drafted)."""
        p = self.p
        out: dict[SeqId, list[int]] = {}
        for n in sorted({n for _, n in verify}):
            group = [row.seq for row, m in verify if m == n]
            masked = MaskedDrafting([(r, masks[sid]) for r, sid in enumerate(group) if sid in masks])
            rows, toks, hid = [], [], []
            for sid in group:
                f, s = self.frontiers[sid], p._seqs[sid]
                if f.done + f.pending() != s.computed:
                    raise ProgramError(f"sequence {sid}: MTP frontier at {f.done} with {f.pending()} hidden states "
                                       f"does not reach computed {s.computed}")
                rows.append(DraftRow(sid, f.done, f.pending()))
                toks.extend(s.ledger[f.done + 1:s.computed + 1])
                hid.append(f.hidden)
            d = self.head.draft(p.kv, rows, torch.tensor(toks, dtype=torch.int64, device=p.device),
                                torch.cat(hid), n, constrain=masked if masked.index else None)
            if masked.index:
                masked.finish(d.tokens)
            for sid, ds in zip(group, d.tokens.tolist(), strict=True):
                out[sid] = ds
        return [out[row.seq] for row, _ in verify]

    def _accept(self, logits: torch.Tensor, verify, drafts: list[list[int]], masks: Mapping[SeqId, VerifyMasks]
                ) -> tuple[list[list[int]], list[tuple[TokenLogprob, ...] | None]]:
        """The committed tokens of each verify row (module docstring: plain sampling's token at each
        position, kept while the drafts agree), and their logprobs for a row that asks for them."""
        p = self.p
        rows: list[tuple[tuple[SeqId, int], RowSampling]] = []
        index, words = [], []
        for row, n in verify:
            rs = row.sampling
            if row.seq in masks:
                index.extend(range(len(rows), len(rows) + n + 1))
                words.append(masks[row.seq].words)
            rows.extend(((row.seq, i), RowSampling(rs.params, rs.seed, rs.step + i)) for i in range(n + 1))
        drafted = {row.seq: d for (row, _), d in zip(verify, drafts, strict=True)}

        def history(key):   # the ledger position i would see: the committed tokens, then d_1..d_i
            sid, i = key
            s = p._seqs[sid]
            return list(s.ledger) + drafted[sid][:i], s.prompt_length

        raw = logits.float()
        masked = mask_rows(raw, index, torch.cat(words)) if words else raw
        processed = penalize(masked, rows, history, p.ops, p.vocab_size)
        x = draw(processed, rows, p.ops, p.vocab_size, lambda _: None)
        width = max(n for _, n in verify)
        dr = torch.zeros((len(verify), width), dtype=torch.int64, device=x.device)
        xs = torch.zeros((len(verify), width + 1), dtype=torch.int64, device=x.device)
        # A constrained row verifies only the drafts its grammar accepts without ending (draft_masks).
        num = [masks[row.seq].valid if row.seq in masks else n for row, n in verify]
        at = 0
        for r, ((_, n), d) in enumerate(zip(verify, drafts, strict=True)):
            dr[r, :n] = torch.tensor(d, dtype=torch.int64)
            xs[r, :n + 1] = x[at:at + n + 1]
            at += n + 1
        acc = greedy_acceptance(dr, xs, torch.tensor(num, dtype=torch.int64, device=x.device))
        committed = acc.to_host()
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

    def _catch_up(self, seqs: list[SeqId]) -> None:
        """Feed the MTP layer every position of ``seqs`` whose next token is in the ledger (one call)."""
        p = self.p
        parts = []
        for sid in seqs:
            f, s = self.frontiers[sid], p._seqs[sid]
            n = min(s.computed, len(s.ledger) - 1) - f.done
            if n > 0:
                parts.append((sid, f, n))
        if not parts:
            return
        toks = [t for sid, f, n in parts for t in p._seqs[sid].ledger[f.done + 1:f.done + n + 1]]
        hidden = torch.cat([f.hidden[:n] for _, f, n in parts])
        ctx = mtp_step_context(p.kv, chunks=[(sid, f.done, n) for sid, f, n in parts], device=p.device)
        self.head.forward(torch.tensor(toks, dtype=torch.int64, device=p.device), hidden, ctx,
                          torch.zeros(0, dtype=torch.int64, device=p.device))
        for _, f, n in parts:
            f.consume(n)

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
                f = self.frontiers[r.seq]
                f.done, f.hidden = v.start, v.hidden[:a].clone()
        self._verify_batch = None

    def abort(self, pending: PendingBatch) -> None:
        """Drop ``pending``'s verify rows (their live state was never written; the frontier stays)."""
        if self._verify_batch != pending.batch_id:
            return
        for r in pending.rows:
            self._verify.pop(r.seq, None)
        self._verify_batch = None

    def forget(self, seq: SeqId) -> None:
        """Drop ``seq``'s MTP bookkeeping (released, paused, or advanced outside :meth:`run`: a later run starts
        it afresh at ``done = computed``)."""
        self.frontiers.pop(seq, None)
        self._verify.pop(seq, None)

    def _frontier(self, seq: SeqId) -> Frontier:
        f = self.frontiers.get(seq)
        if f is None:
            f = self.frontiers[seq] = Frontier(done=self.p.computed(seq))
        return f

