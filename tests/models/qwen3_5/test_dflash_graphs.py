"""DFlash block graphs (ninfer_qwen3_5.dflash.graphs): a full block of every row runs the static-input forward (on the
CPU eagerly, on CUDA as a captured graph) and must give bitwise the eager block's outputs, logits and greedy drafts.

The worlds, the Program and the engine-like driver are test_dflash_program's. Drafts never change the committed
tokens (acceptance makes them plain decoding's), so the Program-level check compares the draft calls' own tokens
with a Program that never captured graphs.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import ProgramError
from ninfer_qwen3_5.dflash.drafter import BlockRow
from ninfer_qwen3_5.dflash.graphs import DFlashGraphs
from ninfer_qwen3_5.dflash.propose import argmax_path, select_path

from . import test_dflash_program as tdp
from .test_speculative_program import Driver, greedy, seeded

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Beside the shared worlds: a DFlash2 drafter without windows (default-dflash2 has a 16-token window) and a DFlash
# drafter whose layers are causal.
tdp.WORLDS.setdefault("dense-dflash2", ("dense", dict(tdp.TINY_DRAFT, generation=2)))
tdp.WORLDS.setdefault("dense-dflash-causal", ("dense", dict(tdp.TINY_DRAFT, generation=1, is_causal=True)))


@pytest.fixture(params=["dense-dflash", "dense-dflash-causal", "dense-dflash2", "default-dflash2"])
def world(request, tmp_path_factory):
    return tdp._world(request.param, tmp_path_factory)


def eager_draft(prog, rows: list[BlockRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager block, logits and greedy path of ``rows`` (all of one length), as DFlashDecoding.draft runs them."""
    d = prog.speculation.drafter
    b, n = len(rows), rows[0].length - 1
    hidden = d.block_hidden(prog.kv, rows)
    h = hidden.index_select(0, torch.arange(b * n)).view(b, n, -1)
    logits = d.logits(h)
    if d.cfg.generation == 1:
        return hidden, logits, argmax_path(logits)
    drafts, _ = select_path(logits, prog.ops.linear(h, d.selector_hidden), torch.tensor([r.anchor for r in rows]),
                            d.selector_predecessor, d.selector_successor, d.cfg.selector_top_k, [0.0] * b, [0] * b,
                            [0] * b)
    return hidden, logits, drafts


def scattered(prog, n: int, tokens: int) -> list:
    """``n`` sequences whose pages interleave (one page each in turn), covering ``tokens`` tokens each, and random
    drafter context K/V in every pool the drafter reads."""
    seqs = [prog.open_sequence([1, 2, 3]) for _ in range(n)]
    ps = prog.kv.page_size
    for upto in range(ps, tokens + ps, ps):
        for s in seqs:
            assert prog.kv.ensure(s, min(upto, tokens))
    g = torch.Generator().manual_seed(11)
    for layer in prog.speculation.drafter.layers:
        for pool in prog.kv.pools(layer.kv_layer):
            pool.copy_(torch.randn(pool.shape, generator=g).to(pool.dtype))
    return seqs


def graphs_for(prog, max_rows: int, k: int) -> DFlashGraphs:
    g = DFlashGraphs(prog.speculation.drafter, prog.kv, max_rows=max_rows, length=k + 1,
                     max_pages=prog.kv.pages_for(prog.max_context))
    g.capture()
    return g


@pytest.mark.parametrize("k", [3, 7])   # blocks of 4 and 8
def test_the_static_block_gives_the_eager_block_bitwise(world, k):
    """Row counts 1..3, rows at different context lengths on interleaved pages: the static forward's normed outputs,
    logits and greedy drafts equal the eager step's bit for bit."""
    prog = tdp.program(world, k)
    seqs = scattered(prog, 3, 120)
    graphs = graphs_for(prog, 3, k)
    window = graphs.window
    g = torch.Generator().manual_seed(k)
    for starts in ([0], [5, 41], [17, 3, 96], [63, 64, 1]):
        if window is not None:   # a graph covers blocks no window cuts
            starts = [s % (window - k) for s in starts]
        rows = [BlockRow(seqs[r], s, int(torch.randint(0, world.vocab, (1,), generator=g)), k + 1)
                for r, s in enumerate(starts)]
        assert graphs.fits(rows)
        want = eager_draft(prog, rows)
        got = graphs.run(rows)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and torch.equal(a, b)


def test_stale_static_inputs_are_caught(tmp_path_factory):
    """The comparison can fail: replaying graph 2 on the static inputs of an earlier step's rows (no input copy)
    does not give the eager drafts of new rows."""
    w, k = tdp._world("dense-dflash", tmp_path_factory), 3
    prog = tdp.program(w, k)
    seqs = scattered(prog, 2, 120)
    graphs = graphs_for(prog, 2, k)
    old = [BlockRow(seqs[0], 9, 5, k + 1), BlockRow(seqs[1], 30, 7, k + 1)]
    new = [BlockRow(seqs[1], 70, 11, k + 1), BlockRow(seqs[0], 44, 13, k + 1)]
    graphs.run(old)
    stale = graphs.replay(2)
    want = eager_draft(prog, new)
    assert not torch.equal(stale[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(graphs.run(new), want, strict=True))


def test_what_the_graphs_do_not_fit(default_world_2):
    prog, graphs, seqs = default_world_2
    w = graphs.window
    assert w is not None
    full = [BlockRow(seqs[0], 0, 1, 4), BlockRow(seqs[1], w - 4, 1, 4)]
    assert graphs.fits(full)
    assert not graphs.fits([BlockRow(seqs[0], 0, 1, 4), BlockRow(seqs[1], w - 3, 1, 4)])   # a window cuts
    assert not graphs.fits([BlockRow(seqs[0], 0, 1, 3), BlockRow(seqs[1], 0, 1, 3)])        # another length
    assert not graphs.fits([BlockRow(s, 0, 1, 4) for s in (*seqs, seqs[0])])               # no graph for 3 rows
    with pytest.raises(ProgramError, match="no DFlash block graph for 3 rows"):
        graphs.run([BlockRow(s, 0, 1, 4) for s in (*seqs, seqs[0])])
    with pytest.raises(ProgramError, match="does not fit graph"):
        graphs.run([BlockRow(seqs[0], 200, 1, 4)])


@pytest.fixture
def default_world_2(tmp_path_factory):
    prog = tdp.program(tdp._world("default-dflash2", tmp_path_factory), 3)
    seqs = scattered(prog, 2, 64)
    return prog, graphs_for(prog, 2, 3), seqs


def recording(m) -> list[list[list[int]]]:
    calls, real = [], m.draft

    def draft(*args, **kwargs):
        d = real(*args, **kwargs)
        calls.append(d.tokens)
        return d

    m.draft = draft
    return calls


def counting(graphs: DFlashGraphs) -> list[int]:
    runs, real = [], graphs.run
    graphs.run = lambda rows: runs.append(len(rows)) or real(rows)
    return runs


@pytest.mark.parametrize("name", ["dense-dflash", "dense-dflash2"])
@pytest.mark.parametrize("sampling", [greedy, seeded], ids=["greedy", "seeded"])
def test_a_program_with_block_graphs_drafts_what_the_eager_program_drafts(tmp_path_factory, name, sampling):
    """Program level: the Driver's units (plain rows, verify rows, chunks; one, two and three drafting rows) draft
    the same tokens with the block graphs captured as without; DFlash2's sampled rows draft eagerly."""
    w, k = tdp._world(name, tmp_path_factory), 3
    eager = tdp.program(w, k)
    want_calls = recording(eager.speculation)
    want = Driver(eager, tdp.prompts(w), 24, tdp.drafting(k), sampling).run()
    prog = tdp.program(w, k)
    prog.capture_decode_graphs(4)
    graphs = prog.speculation.block_graphs
    assert graphs is not None and graphs.batch_sizes == (1, 2, 3, 4)
    runs = counting(graphs)
    calls = recording(prog.speculation)
    assert Driver(prog, tdp.prompts(w), 24, tdp.drafting(k), sampling).run() == want
    assert calls == want_calls
    if sampling is greedy or name == "dense-dflash":
        assert 3 in runs and 2 in runs, runs
    m, e = prog.speculation, eager.speculation
    assert (m.verified, m.drafted, m.accepted) == (e.verified, e.drafted, e.accepted)
    prog.close_graphs()
    assert prog.speculation.block_graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_block_graphs_draft_the_eager_tokens(tmp_path_factory, dtype):
    """On CUDA with the Triton ops: a captured DFlash / DFlash2 Program drafts every token the eager one drafts."""
    from ninfer.contracts.architecture import ProgramInit, ProgramOptions
    from ninfer.contracts.features import StartupFeatures
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    dev, dt, k = torch.device("cuda"), getattr(torch, dtype), 7
    for name in ("dense-dflash", "dense-dflash2"):
        w = tdp._world(name, tmp_path_factory)
        weights = {n: t.to(dev) for n, t in w.weights.items()}

        def cuda_program(w=w, weights=weights):
            ops = resolve_ops(get_registry().ops, "cuda", dt)
            options = ProgramOptions(device=dev, dtype=dt, max_sequences=4, page_size=8, num_pages=192,
                                     max_context=512, speculative_tokens=k)
            return w.spec.create_program(ProgramInit(config=w.config, weights=weights, ops=ops, options=options,
                                                     features=StartupFeatures(speculative=w.backend)))

        eager = cuda_program()
        want_calls = recording(eager.speculation)
        want = Driver(eager, tdp.prompts(w), 40, tdp.drafting(k), greedy).run()
        prog = cuda_program()
        prog.capture_decode_graphs(4)
        runs = counting(prog.speculation.block_graphs)
        calls = recording(prog.speculation)
        assert Driver(prog, tdp.prompts(w), 40, tdp.drafting(k), greedy).run() == want
        assert 3 in runs and calls == want_calls
