"""Test doubles for the engine: a deterministic toy LM Program and a minimal Frontend.

ToyProgram runs on the real :class:`~ninfer.program.base.SequenceProgram` bookkeeping
(ledgers, a real page allocator and page tables, StateImage slots, PendingBatch rules, penalties and
the reference ``sample`` op); only the model call is a toy. The toy is built so that scheduling bugs
change tokens: its next-token logits depend on a recurrent per-slot hash of every processed token
(like GDN state, it cannot be cut or skipped) and on every K/V entry read back through the page
table (wrong pages or a lost token change the logits; a position mismatch raises).

:func:`reference_tokens` is the independent oracle: the same toy math run sequentially in plain
Python for one request, with no engine, pages or batching.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from ninfer.contracts.frontend import (
    OutputDelta,
    OutputFinal,
    OutputOptions,
    OutputPreview,
    PreparedPrompt,
)
from ninfer.contracts.sampling import SamplingParams
from ninfer.ops.reference.greedy import greedy_tokens
from ninfer.ops.reference.sampling import apply_penalties, sample
from ninfer.program.base import ForwardBatch, SequenceProgram
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateField, StateImageStorage, StateLayout

MASK = (1 << 62) - 1
EOS = 1


class ToyOps:
    """The ops SequenceProgram samples with: the real torch reference implementations."""

    apply_penalties = staticmethod(apply_penalties)
    sample = staticmethod(sample)
    greedy_tokens = staticmethod(greedy_tokens)


def _mix(h: int, token: int, pos: int) -> int:
    return ((h ^ (token * 0x9E3779B1 + pos + 1)) * 0x100000001B3 + 0x2545F491) & MASK


def _toy_logits(h: int, kv: Sequence[tuple[int, int]], vocab: int) -> torch.Tensor:
    acc = 0
    for tok, pos in kv:
        acc = (acc * 1000003 + (tok + 1) * (pos + 7)) & MASK
    g = torch.Generator().manual_seed((h * 31 + acc) & MASK)
    return torch.randn(vocab, generator=g, dtype=torch.float32) * 3.0


class ToyProgram(SequenceProgram):
    """A toy LM on real Program bookkeeping. ``fail_on`` lets a test make a call raise."""

    def __init__(self, *, vocab_size: int = 48, num_pages: int = 256, page_size: int = 4, max_sequences: int = 8,
                 max_context: int = 256, checkpoint_slots: int = 0) -> None:
        kv = PagedKVCache([0], num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=1,
                          dtype=torch.float64, device=torch.device("cpu"))
        layout = StateLayout((StateField("h", (1,), torch.int64),))
        states = StateImageStorage(layout, max_sequences, torch.device("cpu"))
        # Checkpoint slots (the context cache): StateImages of the same layout.
        checkpoints = StateImageStorage(layout, checkpoint_slots, torch.device("cpu")) if checkpoint_slots else None
        super().__init__(vocab_size=vocab_size, kv=kv, states=states, ops=ToyOps(), device=torch.device("cpu"),
                         max_context=max_context, checkpoints=checkpoints)
        self.units: list[tuple[int, tuple[int, ...]]] = []  # (decode rows, each chunk's tokens) of every forward
        self.fail_on: str | None = None
        # Test controls: ``gate`` (set = open) holds the worker inside forward; ``entered`` is set when
        # a forward starts; ``delay`` slows every forward; ``close_gate_on_pause`` holds the first
        # forward after a preemption so a test can act while the victim is paused.
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.delay = 0.0
        # ``hold_at = n``: the n-th forward closes the gate before it runs and sets ``held``, so a test acts at an
        # exact point of the run, however fast or slow the machine (the worker waits inside forward n).
        self.hold_at: int | None = None
        self.held = threading.Event()
        self.forwards = 0
        self.close_gate_on_pause = False
        self.paused_seqs: list[int] = []
        self.opened: list[tuple[int, ...]] = []  # ledgers passed to open_sequence, in order

    def open_sequence(self, tokens, prompt_length=None):
        self.opened.append(tuple(tokens))
        return super().open_sequence(tokens, prompt_length)

    def pause(self, seq, *, snapshot=False):
        self.paused_seqs.append(seq)
        if self.close_gate_on_pause:
            self.close_gate_on_pause = False
            self.entered.clear()
            self.gate.clear()
        return super().pause(seq, snapshot=snapshot)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.forwards += 1
        if self.forwards == self.hold_at:
            self.gate.clear()
            self.held.set()
        self.entered.set()
        self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on == "forward":
            raise RuntimeError("injected forward failure")
        k_pool, v_pool = self.kv.pools(0)
        h = self.states.field("h")
        out = []
        if batch.decode is not None:
            d = batch.decode
            for b in range(len(d.seqs)):
                slot = int(d.slots[b])
                self._step(h, k_pool, v_pool, slot, int(d.tokens[b]), int(d.positions[b]), int(d.slot_mapping[b]))
                out.append(self._logits(h, k_pool, v_pool, slot, d.page_tables[b], int(d.kv_lens[b])))
        for c in batch.chunks:
            for i in range(c.num_tokens):
                self._step(h, k_pool, v_pool, c.slot, int(c.tokens[i]), int(c.positions[i]), int(c.slot_mapping[i]))
            if c.want_logits:
                out.append(self._logits(h, k_pool, v_pool, c.slot, c.page_table[0], c.kv_len))
        self.units.append((0 if batch.decode is None else len(batch.decode.seqs),
                           tuple(c.num_tokens for c in batch.chunks)))
        return torch.stack(out) if out else torch.empty((0, self.vocab_size))

    @staticmethod
    def _step(h, k_pool, v_pool, slot, token, pos, flat) -> None:
        h[slot, 0] = _mix(int(h[slot, 0]), token, pos)
        k_pool.view(-1)[flat] = float(token)
        v_pool.view(-1)[flat] = float(pos)

    def _logits(self, h, k_pool, v_pool, slot, page_table, kv_len) -> torch.Tensor:
        ps = self.page_size
        t = torch.arange(kv_len)
        flat = page_table.to(torch.int64)[t // ps] * ps + t % ps
        keys = k_pool.view(-1)[flat].to(torch.int64).tolist()
        positions = v_pool.view(-1)[flat].to(torch.int64).tolist()
        if positions != list(range(kv_len)):
            bad = next(i for i, p in enumerate(positions) if p != i)
            raise AssertionError(f"KV corruption: position {bad} reads an entry written for {positions[bad]}")
        return _toy_logits(int(h[slot, 0]), list(zip(keys, positions, strict=True)), self.vocab_size)

    def commit(self, pending, accepted):
        if self.fail_on == "commit":
            raise RuntimeError("injected commit failure")
        super().commit(pending, accepted)


def reference_tokens(prompt: Sequence[int], params: SamplingParams, *, vocab_size: int = 48,
                     stop_ids: Sequence[int] = (EOS,), max_context: int = 256) -> list[int]:
    """The oracle: one request alone, token by token, no engine (stops are inclusive, like the session)."""
    assert params.seed is not None
    ledger = list(prompt)
    h = 0
    kv: list[tuple[int, int]] = []
    out: list[int] = []
    pos = 0
    while len(out) < params.max_tokens and len(ledger) < max_context:
        while pos < len(ledger):
            h = _mix(h, ledger[pos], pos)
            kv.append((ledger[pos], pos))
            pos += 1
        logits = _toy_logits(h, kv, vocab_size)[None]
        counts = torch.zeros((1, vocab_size), dtype=torch.int32)
        for t in out:
            counts[0, t] += 1
        mask = torch.zeros((1, vocab_size), dtype=torch.bool)
        mask[0, list(prompt)] = True
        f32 = torch.float32
        logits = apply_penalties(logits, counts, mask, torch.tensor([params.repetition_penalty], dtype=f32),
                                 torch.tensor([params.presence_penalty], dtype=f32),
                                 torch.tensor([params.frequency_penalty], dtype=f32))
        tok = int(sample(logits, torch.tensor([params.temperature], dtype=f32),
                         torch.tensor([params.top_k], dtype=torch.int32), torch.tensor([params.top_p], dtype=f32),
                         torch.tensor([params.min_p], dtype=f32), torch.tensor([params.seed]),
                         torch.tensor([len(out)]))[0])
        out.append(tok)
        ledger.append(tok)
        if tok in stop_ids:
            break
    return out


def token_text(t: int) -> str:
    return f"<{t}>"


class ToySession:
    """Minimal OutputSession: stop tokens (EOS unless ignore_eos, plus stop_token_ids), text ``<id>`` per
    token published one token late (so ``finish`` always has text to flush). Checks its own protocol:
    commit must adopt the latest preview, nothing after finish."""

    def __init__(self, options: OutputOptions) -> None:
        self.stops = set(options.stop_token_ids) | (set() if options.ignore_eos else {EOS})
        self.held: int | None = None
        self.committed: list[int] = []
        self.last: OutputPreview | None = None
        self.finished: str | None = None
        self.preview_calls = 0

    def token_mask(self) -> None:  # never constrained
        return None

    def preview(self, tokens: Sequence[int]) -> OutputPreview:
        assert self.finished is None, "preview after finish"
        self.preview_calls += 1
        held, text, accepted, reason, stop = self.held, [], 0, None, None
        for t in tokens:
            accepted += 1
            if t in self.stops:
                reason, stop = "stop", t
                break
            if held is not None:
                text.append(token_text(held))
            held = t
        deltas = (OutputDelta("content", "".join(text)),) if text else ()
        self.last = OutputPreview(accepted, reason, deltas, stop)
        self._pending = (list(tokens[:accepted]), held if reason is None else held)
        return self.last

    def commit(self, preview: OutputPreview) -> None:
        assert preview is self.last, "commit of a preview that is not the latest"
        toks, held = self._pending
        self.committed.extend(toks)
        self.held = held
        self.last = None

    def finish(self, finish_reason: str) -> OutputFinal:
        assert self.finished is None, "finish called twice"
        self.finished = finish_reason
        flush = (OutputDelta("content", token_text(self.held)),) if self.held is not None else ()
        self.held = None
        content = "".join(token_text(t) for t in self.committed if t not in self.stops)
        return OutputFinal(deltas=flush, content=content, reasoning="")


class ToyFrontend:
    def __init__(self, vocab_size: int = 48, defaults: Mapping[str, Any] | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (EOS,)
        self.sessions: list[ToySession] = []
        self._defaults = dict(defaults or {})

    def encode(self, text: str) -> list[int]:
        return [2 + ord(c) % (self.vocab_size - 2) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(token_text(t) for t in token_ids)

    def prepare_text(self, text: str) -> PreparedPrompt:
        return PreparedPrompt(tuple(self.encode(text)))

    def prepare_chat(self, messages, *, tools=(), enable_thinking=True, add_generation_prompt=True,
                     **template_kwargs) -> PreparedPrompt:
        return self.prepare_text("\n".join(str(m.get("content", "")) for m in messages))

    def open_session(self, options: OutputOptions) -> ToySession:
        s = ToySession(options)
        s.options = options
        self.sessions.append(s)
        return s

    def sampling_defaults(self) -> Mapping[str, Any]:
        return dict(self._defaults)
