"""Speculative verify state of a Qwen3.5 Program: per-position GDN snapshots and the commit that selects one.

A speculating row verifies its k+1 inputs ``[t_last, d_1..d_k]`` at positions ``p..p+k`` in one forward, as a
*verify chunk* (:attr:`ninfer.program.batch.ChunkRows.snapshot_slots`, built by :func:`verify_chunk_rows`),
beside ordinary decode rows and chunks. Per layer kind:

- full attention: exactly a chunk: K/V of all k+1 positions are written, each token attends causally over the
  cached prefix and the earlier verify tokens;
- GDN: the k+1 tokens are stepped as k+1 successive decode steps of the decode op (``gdn_decode``: gates,
  conv update, recurrent step, gated norm), and the state after token ``j`` lands in the row's snapshot ``j``
  (:class:`VerifyPlan`). Qwen3.5's layers do it in one ``gdn_verify`` call per layer for every verify row
  (:class:`VerifyRows`), reading the row's live image and keeping the state on chip between tokens. A layer whose
  step is another op (``GatedDeltaNet.fused_verify`` False) runs token ``j`` of every verify row in one call
  (:class:`VerifyStep`): step 0 reads snapshot 0 itself, into which the Program copied the row's live image
  before the forward (:meth:`SpeculativeSnapshots.stage`, only for models whose ``stages_verify_snapshots``),
  and rewrites it in place; step ``j > 0`` reads snapshot ``j - 1`` and writes snapshot ``j``.

Invariants:

- Snapshot ``j`` holds what ``j + 1`` plain decode steps fed the same op inputs would leave in the live slot:
  the same op on the same per-row values (bit-identical on the CPU reference ops; the projections feeding it
  run with another GEMM row count than a one-row decode, which can move their last bits).
- A verify forward never writes a live StateImage slot; the live image stays the state before ``t_last``
  until :meth:`SpeculativeSnapshots.select`.
- ``select(live_slot, n)`` with ``n`` accepted inputs (``t_last`` counts; ``0 <= n <= k + 1``): ``n = 0`` keeps
  the live image (nothing of the verify is committed); otherwise snapshot ``n - 1`` is copied over it, one
  contiguous image copy. Each recorded row is selected at most once; :meth:`SpeculativeSnapshots.assign`
  starts the next verify and forgets rows of the previous one that were never selected (their live image,
  untouched, is the ``n = 0`` rollback).
- KV needs no rollback: after ``n`` accepted inputs the row's committed KV extent is ``p + n``; the K/V the
  verify left at ``p + n .. p + k`` are never read, because every attention reads only positions below its
  row's KV length, and the call that next covers such a position writes its K/V before reading it. Whatever
  publishes KV pages for reuse (the context cache) must count only committed positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ninfer.contracts.program import ProgramError, SeqId
from ninfer.program.batch import ChunkRows, PackedBatch, to_device
from ninfer.storage.state_image import StateImageStorage, StateLayout


class SpeculativeSnapshots:
    """``max_rows * max_inputs`` snapshot StateImages of the Program's state layout: group ``g`` (the ``g``-th
    speculating row of a verify) owns slots ``g * max_inputs .. g * max_inputs + max_inputs - 1``.

    Every slot is allocated once, here, and owned by this object for its lifetime (ops index the field views
    with the slot ids). ``max_inputs`` is k + 1 for the largest k a row may draft."""

    def __init__(self, layout: StateLayout, max_rows: int, max_inputs: int, device: torch.device) -> None:
        if max_rows < 1 or max_inputs < 1:
            raise ProgramError(f"speculative snapshots need at least one row and one input per row "
                               f"(got {max_rows} rows of {max_inputs})")
        self.max_rows, self.max_inputs = max_rows, max_inputs
        self.storage = StateImageStorage(layout, max_rows * max_inputs, device)
        for _ in range(self.storage.num_slots):
            self.storage.allocate()
        self._rows: dict[int, tuple[int, ...]] = {}   # live slot -> its snapshot slots in the current verify

    def assign(self, live_slots: Sequence[int], num_inputs: Sequence[int]) -> list[tuple[int, ...]]:
        """Start a verify: the snapshot slots of each row (``num_inputs[i]`` = k_i + 1 of them), recorded for
        :meth:`select`. Rows of the previous verify not selected yet are forgotten."""
        if len(live_slots) != len(num_inputs):
            raise ProgramError(f"{len(live_slots)} speculating rows need one input count each, got {len(num_inputs)}")
        if len(live_slots) > self.max_rows:
            raise ProgramError(f"{len(live_slots)} speculating rows exceed the {self.max_rows} configured")
        if len(set(live_slots)) != len(live_slots):
            raise ProgramError(f"a state slot speculates twice in one verify: {list(live_slots)}")
        out = []
        for g, n in enumerate(num_inputs):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_inputs:
                raise ProgramError(f"a verify row takes 1..{self.max_inputs} inputs, got {n!r}")
            out.append(tuple(range(g * self.max_inputs, g * self.max_inputs + n)))
        self._rows = dict(zip(live_slots, out, strict=True))
        return out

    def stage(self, live: StateImageStorage, live_slot: int, snapshot_slot: int) -> None:
        """Copy the live image into the verify's first snapshot (step 0 then advances it in place)."""
        live.copy_image_to(live_slot, self.storage, snapshot_slot)

    def select(self, live: StateImageStorage, live_slot: int, num_inputs: int) -> None:
        """Commit ``num_inputs`` accepted inputs of the row whose live image is ``live_slot`` (see the module
        invariants: 0 keeps the live image, else snapshot ``num_inputs - 1`` is copied over it)."""
        snaps = self._rows.get(live_slot)
        if snaps is None:
            raise ProgramError(f"state slot {live_slot} has no verify to select from (or it was selected)")
        if isinstance(num_inputs, bool) or not isinstance(num_inputs, int) or not 0 <= num_inputs <= len(snaps):
            raise ProgramError(f"state slot {live_slot} verified {len(snaps)} inputs; cannot accept {num_inputs!r}")
        del self._rows[live_slot]
        if num_inputs:
            self.storage.copy_image_to(snaps[num_inputs - 1], live, live_slot)


@dataclass(frozen=True)
class VerifyStep:
    """Token ``j`` of every verify row with more than ``j`` inputs, as one decode-op call: ``rows`` (int64
    [V_j]) their indices in the packed token sequence, ``in_slots`` / ``out_slots`` (int64 [V_j]) the snapshot
    slots read and written (equal at step 0, which advances the staged live image in place). ``span``: ``(first,
    stride)`` when the rows are evenly spaced (``rows[i] == first + stride * i``), so that :attr:`index` selects
    them as a strided view instead of a gather."""

    rows: torch.Tensor
    in_slots: torch.Tensor
    out_slots: torch.Tensor
    span: tuple[int, int] | None = None

    @property
    def index(self) -> torch.Tensor | slice:
        """What selects the step's rows of a per-token tensor: a slice (a view, no kernel) when they are evenly
        spaced, else ``rows`` (a gather)."""
        if self.span is None:
            return self.rows
        first, stride = self.span
        return slice(first, first + stride * (self.rows.shape[0] - 1) + 1, stride)


def row_span(rows: Sequence[int]) -> tuple[int, int] | None:
    """``(first, stride)`` of evenly spaced increasing ``rows`` (one row: stride 1), else None."""
    if len(rows) == 1:
        return rows[0], 1
    stride = rows[1] - rows[0]
    if stride < 1 or any(b - a != stride for a, b in zip(rows, rows[1:], strict=False)):
        return None
    return rows[0], stride


@dataclass(frozen=True)
class VerifyRows:
    """The verify chunks as ``gdn_verify`` takes them (int64 device tensors): chunk ``i``'s tokens are packed rows
    ``starts[i] .. starts[i] + counts[i] - 1``, it reads live StateImage slot ``live_slots[i]`` and writes the
    state after token ``j`` to snapshot ``snapshots[i, j]`` (entries past ``counts[i]`` repeat the last one and
    are never written)."""

    starts: torch.Tensor
    counts: torch.Tensor
    live_slots: torch.Tensor
    snapshots: torch.Tensor


@dataclass(frozen=True)
class VerifyPlan:
    """How the GDN layers run a batch with verify chunks: ``rows``, every verify chunk for one ``gdn_verify`` call
    (which reads the live images itself), or ``steps`` (one ``gdn_decode`` per verify token index, in order,
    after the Program staged each live image into its first snapshot); and ``chunks``, the ordinary chunks as
    host ``(offset in the packed sequence, length, state slot)``."""

    steps: tuple[VerifyStep, ...]
    chunks: tuple[tuple[int, int, int], ...]
    rows: VerifyRows | None = None


def verify_plan(batch: PackedBatch, num_snapshots: int, device: torch.device, *, steps: bool = True) -> VerifyPlan:
    """The :class:`VerifyPlan` of ``batch`` (which has a verify chunk), its indices in one device copy.
    ``steps=False``: no per-token steps (every GDN layer of the model runs ``gdn_verify`` from :class:`VerifyRows`)."""
    verify: list[tuple[int, tuple[int, ...]]] = []
    chunks: list[tuple[int, int, int]] = []
    at = batch.num_decode
    seen: set[int] = set()
    for slot, t, snaps in zip(batch.chunk_slots, batch.chunk_lens, batch.chunk_snapshots, strict=True):
        if snaps is None:
            chunks.append((at, t, slot))
        else:
            if any(not 0 <= s < num_snapshots for s in snaps) or seen.intersection(snaps):
                raise ProgramError(f"verify snapshot slots {snaps} are out of range ({num_snapshots}) or shared")
            seen.update(snaps)
            verify.append((at, snaps))
        at += t
    width = max(len(s) for _, s in verify)
    live = [slot for slot, snaps in zip(batch.chunk_slots, batch.chunk_snapshots, strict=True) if snaps is not None]
    # VerifyRows first: starts, counts, live slots [V each], snapshots [V, width].
    flat: list[int] = [at for at, _ in verify] + [len(snaps) for _, snaps in verify] + live
    for _, snaps in verify:
        flat.extend(snaps)
        flat.extend([snaps[-1]] * (width - len(snaps)))
    sizes: list[int] = []
    spans: list[tuple[int, int] | None] = []
    for j in range(width if steps else 0):
        rows = [(at + j, snaps[max(j - 1, 0)], snaps[j]) for at, snaps in verify if len(snaps) > j]
        for column in zip(*rows, strict=True):
            flat.extend(column)
        sizes.append(len(rows))
        spans.append(row_span([r for r, _, _ in rows]))
    data = to_device(flat, torch.int64, device)
    nv = len(verify)
    fused = VerifyRows(data[:nv], data[nv:2 * nv], data[2 * nv:3 * nv],
                       data[3 * nv:3 * nv + nv * width].view(nv, width))
    steps, o = [], 3 * nv + nv * width
    for v, span in zip(sizes, spans, strict=True):
        steps.append(VerifyStep(data[o:o + v], data[o + v:o + 2 * v], data[o + 2 * v:o + 3 * v], span))
        o += 3 * v
    return VerifyPlan(tuple(steps), tuple(chunks), fused)


def verify_chunk_rows(program, seq: SeqId, start: int, tokens: Sequence[int],
                      snapshot_slots: Sequence[int]) -> ChunkRows:
    """The verify chunk of ``seq``: ``tokens`` (``[t_last, d_1..d_k]``) at positions ``start..start+k``, its K/V
    in the sequence's pages (reserved up to ``start + k + 1``), its state slot read-only, the state after token
    ``j`` into ``snapshot_slots[j]``. ``program`` is a :class:`~ninfer.program.base.SequenceProgram`."""
    end = start + len(tokens)
    return ChunkRows(seq=seq, device=program.device, slot=program.state_slot(seq), start=start,
                     token_ids=tuple(tokens), kv_slots=tuple(program.kv.slot_mapping(seq, start, end)),
                     pages=tuple(program.kv.page_rows([seq], [end])[0]), want_logits=False,
                     snapshot_slots=tuple(snapshot_slots))
