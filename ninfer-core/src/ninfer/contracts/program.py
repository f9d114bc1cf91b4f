"""The Program contract: the one owner of a model instance's physical state and execution.

Ownership (docs/design.md section 4): only the engine worker thread calls a Program. The Program owns
the sequences' token ledgers, the StateImage slots, the paged KV pools and their page tables,
reservations, and the fixed model calls. The engine owns requests, scheduling and publication.

A sequence's *ledger* is its known tokens: prompt, then every accepted output token. ``computed``
counts the ledger tokens whose effect is in the state/KV. A sequence is *decode-ready* when
``computed == len(ledger) - 1`` (the last ledger token is the next input). A prefill or Replay chunk
processes ledger tokens ``[computed, computed + n)``; when it reaches the end of the ledger it
samples the first new token (a fresh prompt); a Replay chunk stops one short so the row joins
decode (its last token is already known and was published before the pause).

Commit protocol: :meth:`Program.run` returns a :class:`PendingBatch` of provisional tokens that is
not yet part of any ledger. The engine previews every row through the Frontend, then calls
:meth:`Program.commit` exactly once with the accepted count of every row (or :meth:`abort_pending`).
The Program enforces (a violation raises :class:`PendingBatchError`, an engine failure)
``0 <= accepted <= produced`` and that every row of the batch appears exactly once. The engine decides
the counts (``ninfer.engine.commit``) by the rest of the rules: a row not finishing and not cancelled
accepts all it produced; ``accepted == 0`` only for cancelled rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ninfer.contracts.expert_cache import ExpertCacheStats, ExpertRouting  # noqa: F401 (re-exported)
from ninfer.contracts.sampling import SamplingParams
from ninfer.errors import NInferError

if TYPE_CHECKING:
    import torch

    from ninfer.contracts.media import MediaInput


class ProgramError(NInferError):
    """A Program call was made against its contract (unknown sequence, wrong state, ...)."""


class PendingBatchError(ProgramError):
    """A PendingBatch was consumed twice, partially, or with accepted counts that break the rules."""


class OutOfSlotsError(ProgramError):
    """No free StateImage slot for a new sequence."""


class CheckpointIntegrityError(ProgramError):
    """A checkpoint's records disagree (covered token count, image, KV prefix, tokens): internal
    corruption, an engine failure, never reported as a cache miss."""


SeqId = int


@runtime_checkable
class TokenMaskProvider(Protocol):
    """The allowed tokens of one row's next sampled token (constrained decoding), borrowed by the
    Program for one round. Layout (shared with xgrammar/llguidance): ``words`` is an int32 CPU tensor
    of ``ceil(vocab / 32)`` words; token ``i`` is allowed when bit ``i % 32`` (LSB first) of word
    ``i // 32`` is set; bits at or past the vocabulary size are ignored. At least one token is allowed."""

    def fill_bitmask(self, words: torch.Tensor) -> None: ...


@runtime_checkable
class DraftMaskProvider(TokenMaskProvider, Protocol):
    """A :class:`TokenMaskProvider` that can also look past drafted tokens, so a speculating Program can
    verify a constrained row (one mask per verified position). ``fill_bitmask_after(tokens, words)`` fills
    ``words`` (same layout) with the allowed tokens after the committed output followed by ``tokens`` and
    returns True; it returns False, and ``words`` is unspecified, when the constraint rejects one of
    ``tokens`` or has ended at or before the last of them (no next token exists). Either way the provider is
    left as it was: what ``fill_bitmask`` gives afterwards does not change."""

    def fill_bitmask_after(self, tokens: Sequence[int], words: torch.Tensor) -> bool: ...


@dataclass(frozen=True)
class RowSampling:
    """How to sample one row. ``step`` is the number of tokens this request has sampled before
    (the RNG counter: with ``seed`` it makes the draw independent of batch membership and replayable).
    ``mask``: when set, tokens it does not allow get logit -inf before penalties and sampling, so
    greedy and seeded draws pick only allowed tokens; top-k/top-p/min-p then work over the allowed
    set. The mask consumes no RNG: each token's noise depends on (seed, step, id) only."""

    params: SamplingParams
    seed: int
    step: int
    mask: TokenMaskProvider | None = field(default=None, compare=False)


@dataclass(frozen=True)
class DecodeRow:
    """One decode step of ``seq``. ``drafts`` (speculative decoding): the most drafted tokens this row may
    verify in this step (0: a plain decode step). Only a Program built with
    ``ProgramOptions.speculative_tokens >= drafts`` accepts ``drafts > 0`` (others raise ProgramError), and
    for a constrained row only when its mask is a :class:`DraftMaskProvider`; the row must then be reserved
    for ``drafts + 1`` tokens, and its PendingRow holds between 1 and ``drafts + 1`` tokens (with a
    logprob per token when the row asks for logprobs) and says how many drafts it verified
    (``PendingRow.drafted``, 0..drafts)."""

    seq: SeqId
    sampling: RowSampling
    drafts: int = 0


@dataclass(frozen=True)
class PrefillChunk:
    """Process the next ``num_tokens`` ledger tokens of ``seq``. ``sampling`` is required exactly when
    the chunk reaches the end of the ledger (a fresh prompt's last chunk)."""

    seq: SeqId
    num_tokens: int
    sampling: RowSampling | None = None


@dataclass(frozen=True)
class ExecutionUnit:
    """One engine step's model call: a compact decode batch of the actual B plus prefill/Replay chunks of
    other sequences, all in one forward. A sequence appears at most once in a unit (as a decode row or as
    one chunk). Sampling rows, in order: every decode row, then each chunk that samples (reaches its
    ledger's end), in ``chunks`` order; a PendingBatch's rows follow that order."""

    decode: tuple[DecodeRow, ...] = ()
    chunks: tuple[PrefillChunk, ...] = ()


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@dataclass(frozen=True)
class PendingRow:
    """One sampling row's provisional tokens: one, or up to ``drafts + 1`` for a speculative decode row
    (the accepted drafts, then the target's own token); committing ``a`` of them keeps the first ``a``.

    ``drafted``: the drafts this row verified (0: a plain decode row or a chunk's sample, also a decode row
    the Program ran plainly although the unit allowed drafts). A verify row holds the ``len(tokens) - 1`` drafts
    the acceptance rule kept, then one token of the target's own, so ``1 <= len(tokens) <= drafted + 1``."""

    seq: SeqId
    tokens: tuple[int, ...]                      # provisional tokens; produced extent = len(tokens)
    logprobs: tuple[TokenLogprob, ...] | None = None
    drafted: int = 0


@dataclass
class PendingBatch:
    """Move-only result of :meth:`Program.run`. Membership is frozen at creation; ``consumed``
    flips once, in commit or abort_pending."""

    batch_id: int
    rows: tuple[PendingRow, ...]
    consumed: bool = field(default=False)

    def row(self, seq: SeqId) -> PendingRow:
        for r in self.rows:
            if r.seq == seq:
                return r
        raise PendingBatchError(f"sequence {seq} is not a member of pending batch {self.batch_id}")


@dataclass(frozen=True)
class ProgramCapacity:
    total_pages: int
    free_pages: int
    total_state_slots: int
    free_state_slots: int
    page_size: int


@dataclass(frozen=True)
class ReplayState:
    """What a paused sequence needs to be rebuilt: its whole ledger (prompt + accepted output).
    Resuming opens a new sequence with this ledger and replays all but its last token."""

    ledger: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointHandle:
    """An immutable restorable position taken from one real execution: a StateImage copy whose
    state covers exactly the first ``covered`` tokens of ``tokens`` (== ``len(tokens)``) and a
    read-only KV prefix of the same ``covered`` tokens. ``checkpoint_id`` is unique per Program."""

    checkpoint_id: int
    covered: int
    tokens: tuple[int, ...] = field(repr=False)


@dataclass(frozen=True)
class SnapshotState:
    """A paused sequence kept restorable (docs/design.md section 5): ``checkpoint`` covers exactly its
    first ``checkpoint.covered`` ledger tokens (its whole computed state at the pause), so a resume
    opens from it and recomputes nothing. The checkpoint is a revocable cache resource: when it is
    dropped the request resumes by Replay of the same ``ledger``."""

    ledger: tuple[int, ...]
    checkpoint: CheckpointHandle

    def as_replay(self) -> ReplayState:
        return ReplayState(self.ledger)


ResumeState = ReplayState | SnapshotState


@dataclass(frozen=True)
class CheckpointFootprint:
    """Where one checkpoint lives now. ``on_device``: its StateImage is in a Device checkpoint slot
    and all its KV pages are on the device (it can be opened from); otherwise some of it is on Host.
    ``private_pages``: its device pages nothing else references (demoting frees them);
    ``cache_only_pages``: its device pages no live sequence holds; ``host_pages``: pages on Host;
    ``demote_bytes``: the Host bytes a demotion needs now (image if on Device + private pages);
    ``restore_pages``: free device pages a restore needs (= ``host_pages``)."""

    on_device: bool
    device_slot: bool
    private_pages: int
    cache_only_pages: int
    host_pages: int
    host_bytes: int
    demote_bytes: int

    @property
    def restore_pages(self) -> int:
        return self.host_pages


@dataclass(frozen=True)
class CheckpointUsage:
    """What the Program's checkpoints hold: ``count`` live checkpoints, ``free_slots`` checkpoint
    StateImage slots left, ``device_bytes`` = their images plus the KV pages only they reference;
    ``host_count`` of them have content on Host, ``host_bytes`` of ``host_budget_bytes`` (0: no
    Host tier)."""

    count: int
    total_slots: int
    free_slots: int
    device_bytes: int
    host_bytes: int = 0
    host_count: int = 0
    host_budget_bytes: int = 0


@dataclass
class LookaheadStats:
    """Monotone counts a Program keeps of its lookahead decode steps (``ninfer.program.lookahead``):
    launched ahead, adopted by the next unit, dropped. All zero for a Program given no lookahead slots."""

    launched: int = 0
    adopted: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class SpeculationStats:
    """Monotone counts of a speculating Program's verify rows (``ProgramOptions.speculative_tokens > 0``):
    ``verifies`` rows verified, ``drafted`` drafts they verified, ``accepted`` drafts the acceptance rule
    kept (before the engine cuts a row at a stop or its budget). All zero for a Program that does not
    speculate."""

    verifies: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class WarmupLimits:
    """The shapes a Program's start-up warm-up must cover (:meth:`Program.warm_up`), as the engine's scheduler
    can make them: at most ``max_rows`` sequences in one unit (each a decode row or one chunk), at most
    ``prefill_chunk`` chunk tokens in a unit without decode rows and at most ``step_tokens`` tokens in a unit
    with them (at least one chunk token, so prefill never stops), and ``speculative_tokens`` drafts per
    speculative decode row (0: the Program does not speculate)."""

    max_rows: int
    prefill_chunk: int
    step_tokens: int
    speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_rows", "prefill_chunk", "step_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ProgramError(f"WarmupLimits.{name} must be an int >= 1, got {v!r}")
        k = self.speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ProgramError(f"WarmupLimits.speculative_tokens must be an int >= 0, got {k!r}")


@dataclass(frozen=True)
class WarmupSummary:
    """What a warm-up ran: ``units`` model calls over ``tokens`` tokens in ``seconds`` (the device finished);
    ``skipped`` planned units it left out because the Program's pages or slots could not hold them."""

    units: int
    tokens: int
    skipped: int
    seconds: float


@runtime_checkable
class Program(Protocol):
    """See the module docstring for the ledger and commit rules.

    Every member is required (``ninfer.program.base.SequenceProgram`` implements them all); a Program
    without decode graphs answers ``capture_decode_graphs`` with ``()`` and makes ``close_graphs`` a no-op.
    """

    page_size: int
    vocab_size: int
    max_context: int             # the longest ledger a sequence may have (prompt and output together)
    device: torch.device         # where its KV pages, StateImages and logits live
    dtype: torch.dtype | None    # its activation dtype (None: it has none, e.g. a test double)
    lookahead_stats: LookaheadStats
    speculation_stats: SpeculationStats
    expert_cache_stats: ExpertCacheStats

    def capture_decode_graphs(self, max_batch: int) -> tuple[int, ...]:
        """Capture decode CUDA graphs for batch sizes ``1..max_batch`` and return the sizes captured (``()``:
        none). Only before any sequence is opened (capture writes state slots and KV pages)."""

    def close_graphs(self) -> None:
        """Drop the decode graphs and their memory pool (the Program then runs decode eagerly)."""

    def warm_up(self, limits: WarmupLimits) -> WarmupSummary:
        """Run the Program's own step paths over synthetic sequences so that every compiled kernel variant a
        unit within ``limits`` can select exists before the engine serves (``ninfer.program.warmup`` says what
        it runs). Only when no sequence is open and no checkpoint is held, after the decode graphs are captured.

        Invariants: afterwards no sequence, KV page reservation, state slot or checkpoint is held, no lookahead
        is outstanding, ``lookahead_stats`` and ``speculation_stats`` read as before, and no later result
        changes (a unit's tokens depend on its rows' ledgers and sampling only). A unit the pages or slots
        cannot hold is skipped, not an error; a failing forward is raised."""

    def capacity(self) -> ProgramCapacity: ...

    def expert_routing(self) -> ExpertRouting:
        """The routing its device caches of host experts observed since the warm-up (empty: it has none). Worker
        thread only, like every call that reads Program state while it runs."""

    def warm_expert_caches(self, routing: ExpertRouting) -> None:
        """Fill the device caches of host experts with the experts ``routing`` (an earlier run's
        :meth:`expert_routing`) used most, and score them as if that routing had just been seen, so the first
        requests hit them. Before the worker starts, after the warm-up. ProgramError when ``routing`` does not
        match the Program's layers and experts; a Program without such caches accepts only an empty one."""

    def open_sequence(self, tokens: Sequence[int], prompt_length: int | None = None,
                      media: Sequence[MediaInput] = ()) -> SeqId:
        """Take a StateImage slot (native-initialised) and start a ledger with ``tokens`` (>= 1).
        ``prompt_length`` (default: all of ``tokens``) separates prompt from already-accepted output,
        which the presence/frequency penalties count: a Replay resume passes the original prompt
        length so its sampling matches the uninterrupted run. ``media``: the prompt's images and videos
        (``ninfer.contracts.media``), whose spans lie in the prompt; every open of the same request (a
        Replay or Snapshot resume too) passes the same media. A Program that cannot take them (no encoder,
        or media that do not fit the prompt) raises ProgramError before taking anything. Raises
        OutOfSlotsError when no slot is free. Takes no KV pages: see reserve_units."""

    def check_media(self, tokens: Sequence[int], prompt_length: int | None,
                    media: Sequence[MediaInput]) -> tuple[int, ...]:
        """Whether :meth:`open_sequence` would take ``media`` with a prompt ``tokens[:prompt_length]`` (default: all
        of ``tokens``): a ProgramError naming the problem otherwise (no encoder, media that do not fit the prompt).
        Opens and changes nothing, so any thread may call it (the engine checks a request at submit). Returns the
        encoder input rows of each *encode unit* of the media, in token order: the smallest pieces the encoder's
        work is split into across steps (:meth:`encode_work`); ``()`` for no media."""

    def encode_work(self, seq: SeqId, end: int) -> tuple[tuple[int, int], ...]:
        """The encoder work a chunk of ``seq`` from ``computed(seq)`` up to ledger index ``end`` would run:
        ``(at, rows)`` for each encode unit whose embeddings that chunk needs and the Program does not hold yet,
        in token order, ``at`` the first ledger index of the chunk that needs it (a chunk that stops before ``at``
        does not encode it) and ``rows`` its encoder input rows. Empty for a sequence without media. The
        scheduler cuts chunks with it to bound a step's encoder work."""

    def reserve_units(self, demands: Mapping[SeqId, int]) -> dict[SeqId, bool]:
        """For each row, atomically make sure KV pages exist for ``n`` more tokens beyond ``computed``.
        A row that cannot be satisfied gets False and keeps what it had; other rows are unaffected."""

    def ledger_length(self, seq: SeqId) -> int: ...

    def computed(self, seq: SeqId) -> int: ...

    def run(self, unit: ExecutionUnit) -> PendingBatch:
        """Execute one unit. Decode rows must be decode-ready and reserved for 1 token (``drafts + 1`` for a
        speculative row, see :class:`DecodeRow`); each chunk's
        sequence must be reserved for its ``num_tokens``. Rows of the result: every decode row, then
        each chunk's sequence that sampled, in the unit's order."""

    def commit(self, pending: PendingBatch, accepted: Mapping[SeqId, int]) -> None:
        """Append each row's accepted tokens to its ledger. Consumes ``pending``."""

    def abort_pending(self, pending: PendingBatch) -> None:
        """Drop every provisional token of ``pending``. Consumes it."""

    def pause(self, seq: SeqId) -> ReplayState:
        """Release the sequence's slot and pages, returning what a Replay resume needs (a
        :class:`CheckpointProgram` may return a :class:`SnapshotState` when asked)."""

    def release(self, seq: SeqId) -> None:
        """Free the sequence's StateImage slot and KV pages. Idempotent per live id is an error:
        releasing an unknown or released id raises ProgramError."""


@runtime_checkable
class CheckpointProgram(Program, Protocol):
    """A Program that can take and restore checkpoints (the context cache).

    Invariants (the Program checks them; a violation raises :class:`CheckpointIntegrityError`):
    - A checkpoint is taken only from a sequence's real state after a completed unit: it covers
      exactly ``computed(seq)`` ledger tokens, never an interpolated position.
    - A checkpoint is immutable: its image lives in its own slot and its KV pages are shared
      read-only (a writer copies a shared page before writing into it).
    - Opening from a checkpoint re-verifies that ``tokens`` starts with the checkpoint's tokens and
      extends past them; the new sequence then has ``computed == covered``.
    """

    def capture_checkpoint(self, seq: SeqId) -> CheckpointHandle | None:
        """Copy ``seq``'s state (covering ``computed(seq)`` tokens) into a free checkpoint slot and
        share its KV prefix. None when no checkpoint slot is free (nothing taken)."""

    def open_sequence_from(self, checkpoint: CheckpointHandle, tokens: Sequence[int],
                           prompt_length: int | None = None, media: Sequence[MediaInput] = ()) -> SeqId:
        """Like :meth:`Program.open_sequence`, but the state starts as a copy of the checkpoint's
        image, the KV history starts as its shared prefix, and ``computed == checkpoint.covered``."""

    def drop_checkpoint(self, checkpoint: CheckpointHandle) -> None:
        """Free the checkpoint's slot, its Host copy and its references to KV pages."""

    def checkpoint_usage(self) -> CheckpointUsage: ...

    def checkpoint_footprint(self, checkpoint: CheckpointHandle) -> CheckpointFootprint: ...

    def configure_host_tier(self, budget_bytes: int) -> None:
        """Give the checkpoints a Host tier of ``budget_bytes`` (0: none); before any demotion."""

    def demote_checkpoint(self, checkpoint: CheckpointHandle) -> bool:
        """Move the checkpoint's Device StateImage (if any) and its private device KV pages to its
        Host copy, freeing the slot and pages. False, changing nothing, when the Host budget cannot
        take them (or there is no Host tier)."""

    def restore_checkpoint(self, checkpoint: CheckpointHandle) -> bool:
        """Bring the checkpoint's Host content back into a Device checkpoint slot and fresh device
        pages and free its Host copy. False, changing nothing, when no slot or too few pages are
        free. A no-op (True) for a checkpoint already on Device."""

    def snapshot_host_bytes(self, seq: SeqId) -> int:
        """The Host bytes a Snapshot pause of ``seq`` needs now (its image and the KV pages only it
        holds)."""

    def pause(self, seq: SeqId, *, snapshot: bool = False) -> ResumeState:
        """With ``snapshot``: checkpoint the sequence at its frontier, free it, and demote the
        checkpoint to Host (a pause exists to free device pages), returning a SnapshotState; a
        Replay state when there is no free checkpoint slot, not enough Host budget, or nothing
        restorable (nothing computed, or the state covers the whole ledger)."""


@runtime_checkable
class ScoringProgram(Program, Protocol):
    """A Program that can run causal scoring (the engine's ``causal_scoring`` purpose).

    ``ops`` is the op set its model calls (``ninfer.ops.registry.OpSet``); scoring computes token
    log-probabilities with its ``token_logprobs`` (the torch reference when the set has no implementation
    for the device and dtype)."""

    ops: Any

    def score_chunk(self, seq: SeqId, num_tokens: int, *, logits: bool = True) -> torch.Tensor | None:
        """Run the next ``num_tokens`` ledger tokens of ``seq`` outside the commit protocol (no sampling, no
        PendingBatch) and advance ``computed`` by them. Returns fp32 logits ``[num_tokens, vocab]``, row ``j``
        the distribution of the ledger token after ``computed + j`` (None, skipping the LM head, with
        ``logits=False``). Requires what a prefill chunk does (no unconsumed PendingBatch, not stale, KV
        reserved up to the chunk's end); the chunk may reach the ledger's end, which leaves the sequence
        stale (only pause and release remain), as does a failing forward."""
