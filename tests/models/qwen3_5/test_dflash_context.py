"""The DFlash drafter's context K/V, written by every target forward (ninfer_qwen3_5.dflash.decoding): one write of all
the forward's tokens, inside the forward, so a verify graph records it and the commit writes nothing.

- Against the per-row writes it replaces (positions computed outside a verify after the forward, each verify row's
  accepted inputs at its commit): with a drafter linear whose rows do not depend on the other rows of a call (as the
  Triton GEMV's do), the Program drafts the same tokens and ends with the same context K/V, bit for bit, while
  verifies accept 0..n drafts.
- A verify forward writes the drafter's pools at its own inputs' slots only (at or past ``computed``, where the
  target writes its KV), in one call.
- A Program with verify and block graphs captured leaves every byte of the drafter's pools and every draft the
  eager Program's (on the CPU the static forwards run eagerly; the ``gpu`` case replays captured graphs, where the
  eager write does not run at all for a replayed verify).

The worlds, Program and driver are test_dflash_program's (and test_dflash_graphs' extra worlds).
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk, RowSampling
from ninfer_qwen3_5.dflash.decoding import DFlashDecoding

from . import test_dflash_program as tdp
from .test_dflash_graphs import counting, recording
from .test_speculative_program import GREEDY, Driver, greedy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

K, STEPS = 7, 40


def drafter_pools(prog) -> list[torch.Tensor]:
    return [pool for layer in prog.speculation.drafter.layers for pool in prog.kv.pools(layer.kv_layer)]


def cut(i: int, j: int, toks) -> int:
    """The engine cuts some verifies short (accepting fewer tokens than the Program produced)."""
    return 1 if (len(toks) > 2 and j % 4 == 3) else len(toks)


def wrong(i: int, j: int):
    """Drafts right up to a varying depth (test_dflash_program.OracleDrafts): verifies accept 0..n."""
    return None if j % 3 == 0 else (i + j) % (K + 1)


class RowwiseLinear:
    """The drafter's ops with ``linear`` run one row at a time: no row's result depends on the other rows of the call,
    so writes batched differently agree bit for bit (the reference GEMM's rows depend on M)."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([self.ops.linear(rows[i:i + 1], weight) for i in range(rows.shape[0])])
        return out.view(*x.shape[:-1], weight.shape[0])


class PerRowCommits(DFlashDecoding):
    """The context writes before the forward made them: positions computed outside a verify once the forward returned,
    each verify row's accepted inputs at its commit; one write per part and per row."""

    keeps_verify_taps = True

    def model_forward(self, packed, ctx):
        return self.p.model.forward(packed.tokens, ctx, packed.logit_rows, aux_layers=self.layers)

    def absorb(self, parts) -> None:
        for part in parts:
            self._write(part.seq, part.start, part.taps)

    def commit_row(self, seq, start, taps, accepted) -> None:
        self._write(seq, start, taps)

    def _write(self, seq, start: int, taps: torch.Tensor) -> None:
        n = taps.shape[0]
        self.drafter.write_context(self.p.kv, taps, torch.arange(start, start + n),
                                   torch.tensor(self.p.kv.slot_mapping(seq, start, start + n)))


def oracle_run(prog, w, want) -> tuple[list[list[int]], list, Driver]:
    """The Driver's greedy run with oracle drafts and cut verifies: its output, the drafter's own draft calls."""
    calls = recording(prog.speculation)
    d = Driver(prog, tdp.prompts(w), STEPS, tdp.drafting(K), greedy, accept=cut)
    tdp.OracleDrafts(prog, d, want, wrong=wrong)
    return d.run(), calls, d


@pytest.mark.parametrize("name", ["dense-dflash", "default-dflash2"])
def test_the_forward_writes_what_the_per_row_commits_wrote(tmp_path_factory, name):
    """Same tokens, same drafts, the same context K/V bit for bit (module docstring), windowed DFlash2 included."""
    w = tdp._world(name, tmp_path_factory)   # noqa: SLF001
    want = tdp.plain(w, STEPS)
    runs = []
    for per_row in (False, True):
        prog = tdp.program(w, K)
        if per_row:
            prog.speculation = PerRowCommits(prog, prog.speculation.drafter, K)
        prog.speculation.drafter.ops = RowwiseLinear(prog.speculation.drafter.ops)
        runs.append((prog, *oracle_run(prog, w, want)))
    (new, out, calls, d), (old, old_out, old_calls, old_d) = runs
    assert out == old_out == want
    assert calls == old_calls
    assert new.speculation.accepted > new.speculation.verified   # most verifies accept several drafts
    for a, b in zip(d.seqs, old_d.seqs, strict=True):
        n = new.computed(a)
        assert n == old.computed(b)
        for (k1, v1), (k2, v2) in zip(tdp._context_kv(new, a, n), tdp._context_kv(old, b, n), strict=True):  # noqa: SLF001
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_verify_forward_writes_its_inputs_slots_only(tmp_path_factory):
    """The block and the verify of one step change the drafter's pools at the verify inputs' slots alone, the
    verify in one write; the commit writes nothing."""
    w = tdp._world("dense-dflash", tmp_path_factory)   # noqa: SLF001
    prog = tdp.program(w, K)
    prompt = tdp.prompts(w)[0]
    seq = prog.open_sequence(prompt)
    prog.reserve_units({seq: len(prompt)})
    pending = prog.run(ExecutionUnit(chunks=(PrefillChunk(seq, len(prompt), RowSampling(GREEDY, 0, 0)),)))
    prog.commit(pending, {seq: 1})
    start = prog.computed(seq)
    assert all(prog.reserve_units({seq: K + 1}).values())
    before = [p.clone() for p in drafter_pools(prog)]
    d = prog.speculation.drafter
    writes, real = [], d.write_context

    def write(kv, aux, positions, slots):
        writes.append((positions.tolist(), slots.tolist()))
        real(kv, aux, positions, slots)

    d.write_context = write
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, 1), drafts=K),)))
    inputs = prog.kv.slot_mapping(seq, start, start + K + 1)
    assert writes == [(list(range(start, start + K + 1)), inputs)]   # one write: the verify's K + 1 inputs
    for old, pool in zip(before, drafter_pools(prog), strict=True):
        changed = (old != pool).flatten(0, 1).flatten(1).any(1).nonzero().flatten().tolist()   # flat slots
        assert changed == sorted(inputs)
    prog.commit(pending, {seq: 1})
    assert len(writes) == 1   # the commit writes nothing


def programs(w, device: str, dtype: str):
    """``make(k)``: a Program of world ``w`` on ``device`` (CPU: the reference ops in fp32; CUDA: Triton)."""
    if device == "cpu":
        return lambda k: tdp.program(w, k)
    from ninfer.contracts.architecture import ProgramInit, ProgramOptions
    from ninfer.contracts.features import StartupFeatures
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    dev, dt = torch.device(device), getattr(torch, dtype)
    weights = {n: t.to(dev) for n, t in w.weights.items()}

    def make(k: int):
        ops = resolve_ops(get_registry().ops, device, dt)
        options = ProgramOptions(device=dev, dtype=dt, max_sequences=4, page_size=8, num_pages=192,
                                 max_context=512, speculative_tokens=k)
        features = StartupFeatures(speculative=w.backend if k else None)
        return w.spec.create_program(ProgramInit(config=w.config, weights=weights, ops=ops, options=options,
                                                 features=features))
    return make


def captured_equals_eager(w, make) -> None:
    want = Driver(make(0), tdp.prompts(w), STEPS, lambda i, j: 0, greedy).run()
    out = {}
    for captured in (False, True):
        prog = make(K)
        if captured:
            prog.capture_decode_graphs(4)
            verify_runs, block_runs = counting(prog.speculation.graphs), counting(prog.speculation.block_graphs)
        for pool in drafter_pools(prog):
            pool.zero_()   # the capture wrote garbage at the first pages; both runs start from zeros
        d = prog.speculation.drafter
        writes, real = [], d.write_context
        d.write_context = lambda *a, real=real, writes=writes: writes.append(1) or real(*a)
        tokens, calls, driver = oracle_run(prog, w, want)
        out[captured] = (prog, tokens, calls, len(writes), len(driver.units))
    (eager, tokens, calls, eager_writes, units), (prog, got, got_calls, writes, got_units) = out[False], out[True]
    assert got == tokens and got_calls == calls and got_units == units
    assert verify_runs and block_runs, (verify_runs, block_runs)
    assert eager_writes == units   # one write per forward
    # A replayed verify graph writes inside the graph (the CPU runs its static forward eagerly).
    assert writes == units - (len(verify_runs) if prog.device.type == "cuda" else 0)
    for a, b in zip(drafter_pools(prog), drafter_pools(eager), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["dense-dflash", "dense-dflash2"])
def test_captured_graphs_write_the_eager_context(tmp_path_factory, name):
    w = tdp._world(name, tmp_path_factory)   # noqa: SLF001
    captured_equals_eager(w, programs(w, "cpu", "float32"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["dense-dflash", "dense-dflash2"])
def test_captured_graphs_write_the_eager_context_on_cuda(tmp_path_factory, name, dtype):
    """On CUDA with the Triton ops: the context write replayed inside the verify graphs leaves the drafter's pools
    exactly as the eager forward's write, and every draft is the eager Program's."""
    w = tdp._world(name, tmp_path_factory)   # noqa: SLF001
    captured_equals_eager(w, programs(w, "cuda", dtype))
