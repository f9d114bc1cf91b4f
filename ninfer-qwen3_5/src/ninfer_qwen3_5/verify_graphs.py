"""CUDA graphs of the speculative verify forward, one per exact count of verifying rows at the full draft length.

A unit in which every row verifies ``k`` drafts (``L = k + 1`` inputs each) and nothing else runs, the steady
state of speculative decoding, is one target forward over ``B * L`` tokens. Eagerly its few hundred launches cost
more host time than the GPU spends on them, which is what speculation was meant to save; a captured graph replays
them with one launch. Any other unit (a plain decode row, a prefill chunk, a row with fewer drafts) runs eagerly.

Invariants:
- Graph ``B``'s token layout is fixed: row ``r``'s inputs are tokens ``r * L .. r * L + L - 1`` and its snapshots are
  the snapshot group ``r`` (:class:`~ninfer_qwen3_5.speculative_state.SpeculativeSnapshots` slots
  ``r * max_inputs + j``, what ``assign`` gives the ``r``-th verify row), so the verify plan (which token steps
  which snapshot) and the chunk offsets are constants recorded at capture.
- Tokens, positions, KV slots, KV lengths, page tables and the rows' live StateImage slots are graph inputs: static
  buffers rewritten before each replay (two host-to-device copies). Where the model's layers read a staged first
  snapshot (``model.stages_verify_snapshots``), the staging copy of each live image runs inside the graph, over the
  live slots input; ``gdn_verify`` reads the live slots input itself.
- A replay computes what the eager verify forward computes for the same rows: the same kernels on the same shapes.
  The one shape that differs, the page-table width (the static ``max_pages`` here), does not change a row's
  result (:mod:`ninfer.ops.triton.attention`).
- Capture runs each forward eagerly first (compiling kernels), then records it, at Program construction while no
  sequence exists: it reads live slots ``0..B-1`` and writes the first KV pages and the snapshots, all garbage
  afterwards (a slot is zeroed when allocated, a page or a snapshot written before it is read).
- The outputs (fp32 logits ``[B * L, V]`` and the drafter's taps) live in graph memory until the next replay of any
  of these graphs: the caller consumes or copies them first. Only the thread that owns the Program replays.
- On a device without CUDA graphs (the CPU) the same object runs the static-input forward eagerly instead of a
  replay (``capture`` records nothing); tests use it to check the static inputs against the packed forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import ChunkRows, PackedBatch
from ninfer.program.graphs import StaticGraphs

from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.speculative_state import VerifyPlan, VerifyRows, VerifyStep

# forward(packed, ctx) -> (fp32 logits of every token, taps of every token): the drafter's ``model_forward``.
VerifyForward = Callable[[PackedBatch, StepContext], tuple[torch.Tensor, torch.Tensor]]


class VerifyGraphs(StaticGraphs):
    """Verify forwards of ``B = 1..max_rows`` rows of ``inputs`` tokens each over ``program`` (a Qwen3.5-family
    Program with speculation configured), captured as CUDA graphs on a CUDA device (module docstring)."""

    what = "verify graph"

    def __init__(self, program, forward: VerifyForward, *, max_rows: int, inputs: int, max_pages: int) -> None:
        snaps = program.snapshots
        if snaps is None:
            raise ProgramError("verify graphs need speculation configured (configure_speculation)")
        if not 1 <= max_rows <= min(snaps.max_rows, program.states.num_slots):
            raise ProgramError(f"verify graphs for up to {max_rows} rows exceed the {snaps.max_rows} snapshot "
                               f"groups or the {program.states.num_slots} state slots")
        if not 1 <= inputs <= snaps.max_inputs or max_pages < 1:
            raise ProgramError(f"verify graphs of {inputs} inputs per row and {max_pages} pages are outside "
                               f"1..{snaps.max_inputs} inputs, >= 1 page")
        super().__init__(program.device, max_rows)
        self.p, self._forward = program, forward
        self.inputs, self.max_pages = inputs, max_pages
        n = max_rows * inputs
        # int64: tokens [0, n), positions [n, 2n), KV slots [2n, 3n), live slots [3n, 3n + max_rows);
        # int32: KV lengths [0, max_rows), page tables from max_rows (graph B's: B rows max_pages apart).
        self.i64 = torch.zeros(3 * n + max_rows, dtype=torch.int64, device=self.device)
        self.i32 = torch.zeros(max_rows + max_rows * max_pages, dtype=torch.int32, device=self.device)
        self._constants: dict[int, tuple] = {}

    # -- the static-input forward ------------------------------------------------------------------
    def _consts(self, b: int) -> tuple:
        """Graph ``b``'s constants: chunk offsets, the verify plan, the staging destinations (kept alive with it)."""
        if b not in self._constants:
            L, mi, dev = self.inputs, self.p.snapshots.max_inputs, self.device
            rows = torch.arange(b, dtype=torch.int64, device=dev)
            cu_q = (torch.arange(b + 1, dtype=torch.int32, device=dev) * L)
            steps = tuple(VerifyStep(rows * L + j, rows * mi + max(j - 1, 0), rows * mi + j, (j, L))
                          for j in range(L if self.p.model.stages_verify_snapshots else 0))
            live = self._views(b)[3]
            fused = VerifyRows(rows * L, torch.full((b,), L, dtype=torch.int64, device=dev), live,
                               rows[:, None] * mi + torch.arange(L, dtype=torch.int64, device=dev))
            self._constants[b] = (cu_q, VerifyPlan(steps, (), fused), rows * mi)
        return self._constants[b]

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        n, big = b * self.inputs, self.max_rows * self.inputs
        i64, i32 = self.i64, self.i32
        tables = i32[self.max_rows: self.max_rows + b * self.max_pages].view(b, self.max_pages)
        return (i64[:n], i64[big: big + n], i64[2 * big: 2 * big + n], i64[3 * big: 3 * big + b],
                i32[:b], tables)

    def _run_static(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.p
        tokens, positions, kv_slots, live, kv_lens, tables = self._views(b)
        cu_q, plan, first_snapshots = self._consts(b)
        snaps = p.snapshots.storage
        if p.model.stages_verify_snapshots:
            p.states.copy_images_to(live, snaps, first_snapshots)
        n = b * self.inputs
        packed = PackedBatch(num_decode=0, num_chunk=n, tokens=tokens, positions=positions, slot_mapping=kv_slots,
                             decode_slots=None, decode_out_slots=None, decode_kv_lens=None, decode_page_tables=None,
                             chunk_slots=(), chunk_lens=(), chunk_cu_q=cu_q, chunk_kv_lens=kv_lens,
                             chunk_page_tables=tables, logit_rows=None)
        ctx = StepContext(num_decode=0, num_chunk=n, positions=positions, cos=None, sin=None, slot_mapping=kv_slots,
                          decode_slots=None, decode_out_slots=None, decode_kv_lens=None, decode_page_tables=None,
                          chunk_slots=(), chunk_lens=(), chunk_cu_q=cu_q, chunk_kv_lens=kv_lens,
                          chunk_page_tables=tables, kv=p.kv, states=p.states, verify=plan, snapshots=snaps)
        return self._forward(packed, ctx)

    # -- capture -----------------------------------------------------------------------------------
    def _valid_inputs(self, b: int) -> None:
        """Row r at positions ``0..L-1`` of the first pages, reading live slot r: valid inputs for every kernel."""
        tokens, positions, kv_slots, live, kv_lens, tables = self._views(b)
        L = self.inputs
        pos = torch.arange(L, dtype=torch.int64, device=self.device)
        tokens.zero_()
        positions.copy_(pos.repeat(b))
        kv_slots.copy_(pos.repeat(b))              # page j holds positions j*page..: the identity table below
        live.copy_(torch.arange(b, dtype=torch.int64, device=self.device))
        kv_lens.fill_(L)
        tables.copy_(torch.arange(self.max_pages, dtype=torch.int32, device=self.device).clamp_max(
            self.p.kv.num_pages - 1).expand(b, -1))

    def capture(self, batch_sizes: Sequence[int] | None = None) -> None:
        if self.p._seqs:
            raise ProgramError("verify graphs must be captured before any sequence is opened")
        super().capture(batch_sizes)

    # -- replay ------------------------------------------------------------------------------------
    def run(self, rows: Sequence[ChunkRows]) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify forward of ``rows`` (verify chunks of :func:`~ninfer_qwen3_5.speculative_state.verify_chunk_rows`,
        ``inputs`` tokens each, whose snapshot slots are the groups ``0..B-1`` in order): ``(logits, taps)`` of every
        token, valid until the next replay."""
        b, L, mi = len(rows), self.inputs, self.p.snapshots.max_inputs
        self.check_rows(b)
        width = max(len(c.pages) for c in rows)
        if width > self.max_pages:
            raise ProgramError(f"a page table of width {width} exceeds the verify graphs' {self.max_pages} pages")
        big = self.max_rows * L
        h64 = torch.empty(3 * big + b, dtype=torch.int64, pin_memory=self._replay)
        h32 = torch.empty(self.max_rows + (b - 1) * self.max_pages + width, dtype=torch.int32, pin_memory=self._replay)
        a64, a32 = h64.numpy(), h32.numpy()
        for r, c in enumerate(rows):
            if len(c.token_ids) != L or c.snapshot_slots != tuple(range(r * mi, r * mi + L)):
                raise ProgramError(f"verify row {r} of sequence {c.seq} does not fit graph {b}: {len(c.token_ids)} "
                                   f"inputs, snapshots {c.snapshot_slots}")
            at = r * L
            a64[at: at + L] = c.token_ids
            a64[big + at: big + at + L] = range(c.start, c.start + L)
            a64[2 * big + at: 2 * big + at + L] = c.kv_slots
            a64[3 * big + r] = c.slot
            a32[r] = c.start + L
            t = self.max_rows + r * self.max_pages
            a32[t: t + len(c.pages)] = c.pages
        self.i64[: h64.shape[0]].copy_(h64, non_blocking=True)
        self.i32[: h32.shape[0]].copy_(h32, non_blocking=True)
        return self.replay(b)

    def close(self) -> None:
        super().close()
        self._constants.clear()
