"""Lookahead decode: the next decode step is launched before this step's tokens reach the host.

Why: the host part of a decode step (the engine's commit, Frontend preview and scheduling, then
preparing the next inputs) is serial with the GPU when each step waits for the previous one's
tokens: ~0.55 ms per step on the H200, 9% of a 9B B=1 step and ~40% of a 35B-A3B one. With
lookahead, :meth:`SequenceProgram.run` launches step n+1 for the same rows from step n's tokens
*on the device* and only then waits for step n's tokens, so the engine commits step n while the GPU
computes step n+1. The engine's contract does not change: the Program *adopts* the lookahead when
the engine's next unit asks for exactly that work, and drops it otherwise.

Invariants (enforced by SequenceProgram):
- A lookahead never changes what the Program has committed. It reads each row's StateImage slot and
  writes the new state into a *spare* slot (``DecodeRows.out_slots``); it writes the KV of position
  ``computed`` (the row's next token) into a page the row holds alone; ``computed`` and the ledger are
  untouched. Dropping it costs only its GPU time.
- Adoption (in ``run``) requires a decode-only unit whose rows are the lookahead's rows or an in-order
  subset of them, and per row: not pending, stale or damaged; the last ledger token is the one the
  lookahead consumed at the same position (the accepted token of the previous batch); the row's KV
  page there is still its own; its RowSampling equals the predicted one (same params and seed,
  step + 1, no mask). Adopting swaps the row's slot with its spare and advances ``computed`` by one:
  what running the unit would have done, with the same kernels on the same inputs (a subset was
  computed in the lookahead's larger batch: equal as far as the kernels are batch-invariant, as for
  any change of batch composition).
- A row whose token drawn now is its last (its ``max_tokens``, or max_context) is left out of the
  lookahead: nothing would adopt its next step.
- Only rows whose next token is decided on the device are eligible (:func:`lookahead_eligible`): no
  allowed-token mask (the grammar matcher advances on the host), no penalties (their counts come from
  the host ledger). Logprobs are fine: a step's log-softmax rows are computed on the device before the
  next step is queued (which overwrites the graph's logits) and come back with the tokens.
- Spare slots: the Program holds ``lookahead_slots`` StateImage slots outside ``capacity()``; a
  lookahead takes one per row and gives one back per row when adopted (the row's old slot) or dropped.
- Everything runs on one CUDA stream, so a slot or page freed after a lookahead was queued is only
  rewritten by work queued after it. Inputs reach the device through pinned, non-blocking copies and
  tokens come back through one (:class:`DeviceTokens`) or, for a decode graph's greedy tokens, through
  pinned memory the graph writes itself, so the host never waits for the stream while a lookahead is
  queued except for the tokens it needs.
- An architecture opts in with ``SequenceProgram.supports_lookahead``: its decode forward honours
  ``out_slots`` and rewrites every StateImage field of the out slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.contracts.program import RowSampling, SeqId
from ninfer.program.graphs import HostTokens


def lookahead_eligible(sampling: RowSampling) -> bool:
    """Whether a row's next token can be drawn on the device alone (see the module docstring)."""
    p = sampling.params
    return (sampling.mask is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0)


def wants_logprobs(sampling: RowSampling) -> bool:
    return sampling.params.logprobs or sampling.params.top_logprobs > 0


def predicted(sampling: RowSampling) -> RowSampling:
    """The RowSampling the engine will send for the row's next token (one more token sampled)."""
    return RowSampling(sampling.params, sampling.seed, sampling.step + 1)


def to_device(data: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data onto ``device`` without waiting for the stream: a pinned buffer and a non-blocking copy
    on CUDA (a pageable copy would synchronise with the queued lookahead); a plain tensor elsewhere."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class DeviceTokens:
    """A step's drawn tokens (device int64 [B]) and, for the rows that asked, their log-softmax rows
    (device fp32 [len(want), V], row i for row ``want[i]``) on their way to the host: the copies are
    queued at construction (behind whatever the stream holds) and :meth:`tolist` / :meth:`logprobs`
    wait for those copies only, not for work queued later. ``host``: the tokens are already on their way
    (a decode graph stores its greedy tokens into pinned memory itself,
    :class:`~ninfer.program.graphs.HostTokens`), so no token copy is queued."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor | None = None,
                 want: Sequence[int] = (), host: HostTokens | None = None) -> None:
        self.device = tokens
        self.want = list(want)
        self._ready: torch.cuda.Event | None = None
        self._graph_host = host
        if tokens.device.type == "cuda":
            self._host = None if host is not None else _pinned_copy(tokens)
            self._lp = None if logprobs is None else _pinned_copy(logprobs)
            if self._host is not None or self._lp is not None:
                self._ready = torch.cuda.Event()
                self._ready.record()
        else:
            self._host, self._lp = tokens, logprobs

    def tolist(self) -> list[int]:
        if self._graph_host is not None:
            return self._graph_host.values()
        if self._ready is not None:
            self._ready.synchronize()
        return [int(t) for t in self._host.tolist()]

    def logprobs(self) -> torch.Tensor | None:
        """The host fp32 log-softmax rows of ``want`` (None when no row asked)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._lp


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class Lookahead:
    """One launched lookahead step (owned by the Program; see the module docstring). Row ``j`` read
    slot ``slots[j]`` at position ``positions[j]`` and wrote ``spares[j]``; ``seqs[j]`` is None once
    the row was released or paused (its spare is then already back in the pool)."""

    seqs: list[SeqId | None]
    positions: list[int]
    spares: list[int | None]
    sampling: list[RowSampling]     # predicted for the next unit's rows
    tokens: DeviceTokens            # the tokens it sampled
    inputs: list[int] | None = None  # the tokens it consumed, once the previous batch's copy landed

    def forget(self, seq: SeqId) -> int | None:
        """Take ``seq``'s row out; returns its spare slot (None if the row is not here)."""
        for j, s in enumerate(self.seqs):
            if s == seq:
                spare, self.seqs[j], self.spares[j] = self.spares[j], None, None
                return spare
        return None

    def live_spares(self) -> list[int]:
        return [s for s in self.spares if s is not None]


@dataclass
class LookaheadStats:
    """Monotone counts (Program-owned): steps launched ahead, adopted by the next unit, dropped."""

    launched: int = 0
    adopted: int = 0
    dropped: int = 0
