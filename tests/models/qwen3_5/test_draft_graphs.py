"""MTP draft graphs (ninfer_qwen3_5.mtp.draft_graphs): steps 2..k of an unconstrained draft run the static-input steps
(on the CPU eagerly, on CUDA as a captured graph) and must draft exactly what the eager steps draft.

The worlds and the engine-like driver are test_speculative_program's. The drafts never change the committed tokens
(acceptance makes them plain decoding's), so the checks that can see a wrong draft are the drafter's counts (how
many drafts were accepted) and the draft calls' own tokens, compared with a Program that never captured graphs.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import ProgramError
from ninfer_qwen3_5.mtp.draft_graphs import DraftGraphs
from ninfer_qwen3_5.mtp.head import DraftRow

from .test_speculative_program import (  # noqa: F401
    Driver,
    default_world,
    greedy,
    program,
    prompts,
    seeded,
    world,
)
from .test_verify_graphs import all_draft

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def recording(head) -> list[torch.Tensor]:
    """Record the tokens of every draft call of ``head`` (a copy each)."""
    calls, real = [], head.draft

    def draft(*args, **kwargs):
        d = real(*args, **kwargs)
        calls.append(d.tokens.clone())
        return d

    head.draft = draft
    return calls


def counting(graphs: DraftGraphs) -> list[int]:
    runs, real = [], graphs.run

    def run(seqs, *args):
        runs.append(len(seqs))
        return real(seqs, *args)

    graphs.run = run
    return runs


@pytest.mark.parametrize("world", ["default", "dense", pytest.param("moe", marks=pytest.mark.slow)], indirect=True)
@pytest.mark.parametrize("sampling", [greedy, seeded], ids=["greedy", "seeded"])
def test_draft_graphs_draft_what_the_eager_steps_draft(world, sampling):  # noqa: F811
    k = 3
    eager = program(world, k)
    eager_calls = recording(eager.speculation.head)
    want = Driver(eager, prompts(world), 24, all_draft(k), sampling).run()

    prog = program(world, k)
    prog.capture_decode_graphs(8)
    graphs = prog.speculation.head.graphs
    assert graphs is not None and graphs.batch_sizes == (1, 2, 3, 4)
    runs = counting(graphs)
    calls = recording(prog.speculation.head)
    assert Driver(prog, prompts(world), 24, all_draft(k), sampling).run() == want
    assert 3 in runs, runs
    assert len(calls) == len(eager_calls)
    for got, ref in zip(calls, eager_calls, strict=True):
        assert torch.equal(got, ref)
    m, e = prog.speculation, eager.speculation
    assert (m.verified, m.drafted, m.accepted) == (e.verified, e.drafted, e.accepted)


def test_a_draft_through_the_graphs_equals_the_eager_draft_at_any_position(default_world):  # noqa: F811
    """Head level, one call each way on the same KV: rows at different positions (so different pages and KV slots
    per step), lengths 1 and 3; the graph's drafts equal the eager steps', and it returns no logits."""
    w, k = default_world, 4
    prog = program(w, k)
    head = prog.speculation.head
    graphs = DraftGraphs(head, prog.kv, max_rows=2, k=k, max_pages=prog.kv.pages_for(prog.max_context),
                         hidden_size=head.cfg.hidden_size, dtype=torch.float32, device=torch.device("cpu"))
    graphs.capture()
    seqs = [prog.open_sequence(p) for p in prompts(w)[:2]]
    for s, n in zip(seqs, (30, 20), strict=True):
        prog.kv.ensure(s, n + k + 2)
    rows = [DraftRow(seqs[0], 17, 1), DraftRow(seqs[1], 5, 3)]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, w.vocab, (4,), generator=g)
    hidden = torch.randn(4, head.cfg.hidden_size, generator=g)
    ref = head.draft(prog.kv, rows, tokens, hidden, k)
    head.graphs = graphs
    got = head.draft(prog.kv, rows, tokens, hidden, k)
    assert got.logits is None and ref.logits is not None
    assert torch.equal(got.tokens, ref.tokens)
    # A different k, or a row count without a graph, takes the eager steps.
    assert head.draft(prog.kv, rows, tokens, hidden, 2).logits is not None
    assert head.draft(prog.kv, rows[:1], tokens[:1], hidden[:1], k).logits is None
    with pytest.raises(ProgramError, match="no draft graph for 3 rows"):
        graphs.run([seqs[0]] * 3, [1, 2, 3], tokens[:3], hidden[:3])
    with pytest.raises(ProgramError, match="needs pages for"):
        graphs.run([seqs[0]], [60], tokens[:1], hidden[:1])


@pytest.mark.parametrize("pending", [1, 2, 4, 5])
def test_a_whole_draft_through_the_graphs_equals_the_eager_draft(default_world, pending):  # noqa: F811
    """Head level: rows that all have ``pending`` positions (one: decode rows; more: chunks), at different start
    positions, draft through the whole-draft graph exactly what the eager steps draft; rows of unequal lengths, a
    row count without a graph, or another k take the other paths."""
    w, k = default_world, 4
    prog = program(w, k)
    head = prog.speculation.head
    graphs = DraftGraphs(head, prog.kv, max_rows=2, k=k, max_pages=prog.kv.pages_for(prog.max_context),
                         hidden_size=head.cfg.hidden_size, dtype=torch.float32, device=torch.device("cpu"),
                         pending=pending)
    graphs.capture()
    seqs = [prog.open_sequence(p) for p in prompts(w)[:2]]
    for s, n in zip(seqs, (30, 20), strict=True):
        prog.kv.ensure(s, n + k + pending + 2)
    rows = [DraftRow(seqs[0], 17, pending), DraftRow(seqs[1], 5, pending)]
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, w.vocab, (2 * pending,), generator=g)
    hidden = torch.randn(2 * pending, head.cfg.hidden_size, generator=g)
    ref = head.draft(prog.kv, rows, tokens, hidden, k)
    runs = []
    real = graphs.run_whole
    graphs.run_whole = lambda *a: runs.append(len(a[0])) or real(*a)
    head.whole_graphs = {pending: graphs}
    got = head.draft(prog.kv, rows, tokens, hidden, k)
    assert runs == [2] and got.logits is None and ref.logits is not None
    assert torch.equal(got.tokens, ref.tokens)
    one = head.draft(prog.kv, rows[:1], tokens[:pending], hidden[:pending], k)
    assert runs == [2, 1] and torch.equal(one.tokens, ref.tokens[:1])
    assert head.draft(prog.kv, rows, tokens, hidden, k - 1).logits is not None       # another k: eager
    if pending > 1:   # unequal lengths: eager
        mixed = [DraftRow(seqs[0], 17, pending), DraftRow(seqs[1], 5, pending - 1)]
        assert head.draft(prog.kv, mixed, tokens[:-1], hidden[:-1], k).logits is not None
    assert runs == [2, 1]
    with pytest.raises(ProgramError, match="run_whole"):
        graphs.run([seqs[0]], [3], tokens[:1], hidden[:1])
    with pytest.raises(ProgramError, match="need 2 tokens|need 4 tokens|need 8 tokens|need 10 tokens"):
        graphs.run_whole(seqs, [17, 5], tokens[:1], hidden[:1])


def test_the_program_captures_whole_draft_graphs_for_every_pending_count(default_world):  # noqa: F811
    """k + 1 whole-draft graph sets (pending 1..k+1) beside the steps-2..k set, used by an engine-like run whose
    drafts equal a graph-free Program's; closed with the Program's graphs."""
    w, k = default_world, 3
    eager = program(w, k)
    eager_calls = recording(eager.speculation.head)
    want = Driver(eager, prompts(w), 24, all_draft(k), greedy).run()
    prog = program(w, k)
    prog.capture_decode_graphs(4)
    head = prog.speculation.head
    assert sorted(head.whole_graphs) == [1, 2, 3, 4]
    assert all(g.batch_sizes == (1, 2, 3, 4) and g.k == k for g in head.whole_graphs.values())
    runs = []
    for g in head.whole_graphs.values():
        real = g.run_whole
        g.run_whole = lambda *a, _real=real: runs.append(len(a[0])) or _real(*a)
    calls = recording(head)
    assert Driver(prog, prompts(w), 24, all_draft(k), greedy).run() == want
    assert runs, "no draft took a whole-draft graph"
    assert len(calls) == len(eager_calls)
    for got, ref in zip(calls, eager_calls, strict=True):
        assert torch.equal(got, ref)
    prog.close_graphs()
    assert head.whole_graphs == {} and head.graphs is None


def test_draft_graphs_need_two_steps_and_close_with_the_program(default_world):  # noqa: F811
    w = default_world
    prog = program(w, 1)
    prog.capture_decode_graphs(4)
    assert prog.speculation.head.graphs is None   # k = 1: step 1 is all there is
    head = prog.speculation.head
    with pytest.raises(ProgramError, match="k >= 2"):
        DraftGraphs(head, prog.kv, max_rows=1, k=1, max_pages=4, hidden_size=head.cfg.hidden_size,
                    dtype=torch.float32, device=torch.device("cpu"))
    prog = program(w, 2)
    prog.capture_decode_graphs(4)
    assert prog.speculation.head.graphs.batch_sizes == (1, 2, 3, 4)
    prog.close_graphs()
    assert prog.speculation.head.graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_draft_graphs_draft_the_eager_tokens(default_world, dtype):  # noqa: F811
    """On CUDA with the Triton ops: the replayed draft graphs draft every token the eager steps draft, so the
    drafter's counts agree too, greedy and seeded."""
    from ninfer.contracts.architecture import ProgramInit, ProgramOptions
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    w, k, dev, dt = default_world, 3, torch.device("cuda"), getattr(torch, dtype)
    weights = {name: t.to(dev) for name, t in w.weights.items()}

    def cuda_program():
        ops = resolve_ops(get_registry().ops, "cuda", dt)
        options = ProgramOptions(device=dev, dtype=dt, max_sequences=4, page_size=8, num_pages=192, max_context=512,
                                 speculative_tokens=k)
        return w.spec.create_program(ProgramInit(config=w.config, weights=weights, ops=ops, options=options))

    for sampling in (greedy, seeded):
        eager = cuda_program()
        eager_calls = recording(eager.speculation.head)
        want = Driver(eager, prompts(w), 40, all_draft(k), sampling).run()
        prog = cuda_program()
        prog.capture_decode_graphs(4)
        runs = counting(prog.speculation.head.graphs)
        calls = recording(prog.speculation.head)
        assert Driver(prog, prompts(w), 40, all_draft(k), sampling).run() == want
        assert 3 in runs
        for got, ref in zip(calls, eager_calls, strict=True):
            assert torch.equal(got, ref)
        m, e = prog.speculation, eager.speculation
        assert (m.verified, m.drafted, m.accepted) == (e.verified, e.drafted, e.accepted)
        prog.close_graphs()


def test_a_failed_capture_leaves_drafting_eager_with_a_warning(default_world, monkeypatch, caplog):  # noqa: F811
    w = default_world

    def fail(self, batch_sizes=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DraftGraphs, "capture", fail)
    prog = program(w, 3)
    with caplog.at_level("WARNING", logger="ninfer_qwen3_5.mtp.decoding"):
        assert prog.capture_decode_graphs(4) == (1, 2, 3, 4)   # the verify graphs are there
    assert prog.speculation.head.graphs is None
    assert "MTP draft graphs could not be captured (RuntimeError: operation not permitted" in caplog.text
    want = Driver(program(w, 0), prompts(w), 12, lambda i, j: 0, greedy).run()
    assert Driver(prog, prompts(w), 12, all_draft(3), greedy).run() == want
