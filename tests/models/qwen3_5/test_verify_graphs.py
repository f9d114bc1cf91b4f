"""Verify graphs (ninfer_qwen3_5.verify_graphs): units of verify rows only, each of the full k drafts, run the
static-input forward (on the CPU eagerly, on CUDA as a captured graph) and must leave exactly what the eager packed
forward leaves: the same committed tokens, the same live StateImages and KV, the same drafter counts.

The worlds and the engine-like driver are test_speculative_program's. Every decode step drafts k (but where the
driver cuts a row near its end), so most units are verify-only, of 3 rows (fewer as rows finish); the first units mix plain
decode rows and chunks and stay eager.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import ProgramError

from .test_speculative_program import (  # noqa: F401
    Driver,
    default_world,
    greedy,
        program,
    prompts,
    seeded,
    world,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def counting(prog) -> list[int]:
    """Record the row count of every verify-graph run of ``prog``."""
    graphs, runs = prog.speculation.graphs, []
    real = graphs.run

    def run(rows):
        runs.append(len(rows))
        return real(rows)

    graphs.run = run
    return runs


def all_draft(k: int):
    # Sequence 0's first decode step is plain, as in test_speculative_program (a mixed unit stays eager).
    return lambda i, j: 0 if i == 0 and j == 0 else k


def live_state(prog, d: Driver) -> list[torch.Tensor]:
    """Each sequence's live StateImage bytes and its KV, position by position, in every full-attention pool."""
    out = []
    for seq in d.seqs:
        s = prog._seqs[seq]   # noqa: SLF001
        out.append(prog.states._raw[s.slot].clone())   # noqa: SLF001
        n = prog.computed(seq)
        slots = torch.tensor(prog.kv.slot_mapping(seq, 0, n))
        for layer in prog.layout.kv.layers:
            for pool in prog.kv.pools(layer):
                out.append(pool.reshape(-1, *pool.shape[2:])[slots].clone())
    return out


@pytest.mark.parametrize("world", ["default", "dense", pytest.param("moe", marks=pytest.mark.slow)], indirect=True)
def test_verify_graphs_commit_what_the_eager_forward_commits(world):  # noqa: F811
    # The eager speculative output is itself plain greedy's (test_speculative_program); here the graphs must
    # reproduce the eager run exactly, tokens and every byte of state.
    k = 3
    eager = program(world, k)
    d_eager = Driver(eager, prompts(world), 24, all_draft(k), greedy)
    want = d_eager.run()

    prog = program(world, k)
    assert prog.capture_decode_graphs(8) == (1, 2, 3, 4)   # max_sequences 4 bounds the snapshot groups
    runs = counting(prog)
    d = Driver(prog, prompts(world), 24, all_draft(k), greedy)
    assert d.run() == want
    assert 3 in runs, runs   # three rows verify together (fewer as rows finish, when acceptance differs)
    m, e = prog.speculation, eager.speculation
    assert (m.verified, m.drafted, m.accepted) == (e.verified, e.drafted, e.accepted)
    for a, b in zip(live_state(prog, d), live_state(eager, d_eager), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["dense-dflash", pytest.param("moe-dflash2", marks=pytest.mark.slow)])
def test_dflash_drafters_through_the_graphs_commit_what_the_eager_forward_commits(tmp_path_factory, name):
    """A DFlash drafter taps some layers' outputs instead of the final hidden states: the graphs hand it the same."""
    from . import test_dflash_program as dflash

    w, k = dflash._world(name, tmp_path_factory), 7   # noqa: SLF001
    eager = dflash.program(w, k)
    d_eager = Driver(eager, dflash.prompts(w), 24, all_draft(k), greedy)
    want = d_eager.run()
    prog = dflash.program(w, k)
    prog.capture_decode_graphs(4)
    runs = counting(prog)
    d = Driver(prog, dflash.prompts(w), 24, all_draft(k), greedy)
    assert d.run() == want
    assert 3 in runs, runs
    for a, b in zip(live_state(prog, d), live_state(eager, d_eager), strict=True):
        assert torch.equal(a, b)


def test_seeded_rows_through_the_graphs_commit_plain_sampled_tokens(default_world):  # noqa: F811
    w, k = default_world, 1
    want = Driver(program(w, 0), prompts(w), 16, lambda i, j: 0, seeded).run()
    prog = program(w, k)
    prog.capture_decode_graphs(4)
    runs = counting(prog)
    assert Driver(prog, prompts(w), 16, all_draft(k), seeded).run() == want
    assert runs


def test_units_that_do_not_fit_a_graph_run_eagerly(default_world):  # noqa: F811
    # k = 3 graphs; rows drafting 2 (or a plain row beside verify rows) never reach them.
    w = default_world
    prog = program(w, 3)
    prog.capture_decode_graphs(4)
    runs = counting(prog)
    want = Driver(program(w, 0), prompts(w), 16, lambda i, j: 0, greedy).run()
    assert Driver(prog, prompts(w), 16, lambda i, j: 0 if i == 0 and j == 0 else 2, greedy).run() == want
    assert runs == []


def test_capture_needs_an_empty_program_and_a_run_needs_a_captured_size(default_world):  # noqa: F811
    w = default_world
    prog = program(w, 2)
    seq = prog.open_sequence(prompts(w)[0])
    with pytest.raises(ProgramError, match="before any sequence"):
        prog.capture_decode_graphs(2)
    prog.release(seq)
    prog.capture_decode_graphs(2)
    with pytest.raises(ProgramError, match="no verify graph for 3 rows"):
        prog.speculation.graphs.run([None] * 3)
    prog.close_graphs()
    assert prog.speculation.graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_verify_graphs_replay_the_eager_forward_bitwise(default_world, dtype):  # noqa: F811
    """On CUDA with the Triton ops: the replayed graphs commit the tokens, live StateImages and KV of the eager
    verify forward, bit for bit, greedy and seeded."""
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
        d_eager = Driver(eager, prompts(w), 40, all_draft(k), sampling)
        want = d_eager.run()
        prog = cuda_program()
        assert prog.capture_decode_graphs(4) == (1, 2, 3, 4)
        runs = counting(prog)
        d = Driver(prog, prompts(w), 40, all_draft(k), sampling)
        assert d.run() == want
        assert 3 in runs
        for a, b in zip(live_state(prog, d), live_state(eager, d_eager), strict=True):
            assert torch.equal(a, b)
        prog.close_graphs()
