"""The Qwen3.5 Program's execution invariants (fp32 reference ops, CPU).

A request's tokens must not depend on chunking, batch membership, page size or page placement,
reservations of other rows, or a pause/Replay (docs/design.md section 8). Logits are compared with a tight
tolerance (3e-4: only summation order differs, e.g. a 1-token chunk vs a 16-token chunk of the delta
rule, or the fused [qkv | z] projection taking another CPU GEMM kernel at M = 1 than at M = 17; the
random 9-layer "odd" model amplifies fp32 rounding ~1000x, measured max 1.7e-4 there) and greedy tokens
exactly. A semantic error (a state not carried across a chunk boundary) moves logits by O(0.1).
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk, RowSampling
from ninfer.contracts.sampling import SamplingParams

from .harness import Runner, make_program, prompt, split

TOL = 3e-4
STEPS = 10


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, atol=TOL, rtol=0) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def dense(qwen_case):
    return qwen_case("dense")


@pytest.fixture(scope="module")
def baseline(dense):
    """Alone, one whole-prompt chunk, page size 4: tokens and logits per prompt length."""
    out = {}
    for length in (2, 5, 9, 14, 20):
        run = Runner(make_program(dense))
        toks = run.generate(prompt(length, length), STEPS)
        out[length] = (toks, next(iter(run.logits.values())))
    return out


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_equals_whole_prefill(dense, baseline, chunk):
    run = Runner(make_program(dense))
    toks = run.generate(prompt(20, 20), STEPS, chunks=split(20, chunk))
    ref_toks, ref_logits = baseline[20]
    assert toks == ref_toks
    assert _close(next(iter(run.logits.values())), ref_logits)


def test_odd_geometry_chunked_prefill_matches_whole(qwen_case):
    """Hv = 3 Hk, Dv != Dk, 9 layers: chunk boundaries inside the conv window and the delta rule."""
    case = qwen_case("odd")
    ids = prompt(5, 17)
    whole = Runner(make_program(case))
    ref = whole.generate(ids, 6)
    chunked = Runner(make_program(case))
    assert chunked.generate(ids, 6, chunks=[1, 2, 3, 11]) == ref
    assert _close(next(iter(chunked.logits.values())), next(iter(whole.logits.values())))


def test_batch_of_four_equals_each_alone(dense, baseline):
    lengths = (5, 9, 2, 14)
    run = Runner(make_program(dense))
    seqs = [run.open(prompt(n, n)) for n in lengths]
    toks = {s: [] for s in seqs}
    # Each prompt's prefill shares its unit with the decode rows of the sequences started before it.
    for i, s in enumerate(seqs):
        out = run.unit(decode=seqs[:i], chunk=(s, lengths[i]))
        for k, t in out.items():
            toks[k].append(t)
    while any(len(t) < STEPS for t in toks.values()):
        live = [s for s in seqs if len(toks[s]) < STEPS]
        for k, t in run.unit(decode=live).items():
            toks[k].append(t)
    for s, n in zip(seqs, lengths, strict=True):
        assert toks[s] == baseline[n][0], f"prompt of length {n}"
        assert _close(run.logits[s], baseline[n][1])


def test_several_chunks_in_one_unit_equal_each_alone(dense, baseline):
    """Chunks of several sequences packed into one unit with decode rows (issue 30): every sequence's
    tokens and logits are those of its whole-prompt run alone; the sampling rows come out as the decode
    rows, then each chunk that reaches its ledger's end, in unit order."""
    lengths = (5, 9, 2, 14)
    run = Runner(make_program(dense))
    a, b, c, d = (run.open(prompt(n, n)) for n in lengths)
    toks: dict[int, list[int]] = {s: [] for s in (a, b, c, d)}
    plan = [([], [(a, 3), (b, 4), (c, 2)]),          # c samples
            ([c], [(a, 2), (b, 5), (d, 6)]),         # a and b sample, d does not
            ([c, a, b], [(d, 8)])]                   # d samples
    for decode, chunks in plan:
        out = run.unit(decode=decode, chunks=chunks)
        ended = [s for s, n in chunks if run.p.computed(s) == run.p.ledger_length(s) - 1]
        assert list(out) == list(decode) + ended
        for k, t in out.items():
            toks[k].append(t)
    while any(len(t) < STEPS for t in toks.values()):
        for k, t in run.unit(decode=[s for s in toks if len(toks[s]) < STEPS]).items():
            toks[k].append(t)
    for s, n in zip((a, b, c, d), lengths, strict=True):
        assert toks[s] == baseline[n][0], f"prompt of length {n}"
        assert _close(run.logits[s], baseline[n][1])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_sizes_and_fragmented_pages_give_identical_results(dense, baseline, page_size):
    prog = make_program(dense, page_size=page_size, num_pages=512 // page_size, max_sequences=4)
    run = Runner(prog)
    # Fragment the free list: three sequences take pages in turn, then the middle one leaves.
    fillers = [run.open(prompt(100 + i, 3)) for i in range(3)]
    for _ in range(3):
        for f in fillers:
            assert prog.reserve_units({f: prog.kv.capacity(f) + page_size})[f]
    prog.release(fillers[1])
    a, b = run.open(prompt(9, 9)), run.open(prompt(14, 14))
    toks = {a: [run.prefill(a)], b: [run.prefill(b)]}
    for _ in range(STEPS - 1):  # a and b grow together: their pages interleave
        for k, t in run.unit(decode=[a, b]).items():
            toks[k].append(t)
    table = prog.kv.table(b)
    assert table != tuple(range(table[0], table[0] + len(table))), "pages were expected to be non-contiguous"
    assert toks[a] == baseline[9][0] and toks[b] == baseline[14][0]
    assert _close(run.logits[a], baseline[9][1]) and _close(run.logits[b], baseline[14][1])


def test_reserve_refusing_one_row_leaves_the_others_alone(dense, baseline):
    # 6 pages of 4: two 7-token prompts fit in 2 pages with room for one more token; the
    # 8-token prompt fills its 2 pages exactly and needs a fresh page that does not exist.
    prog = make_program(dense, page_size=4, num_pages=6)
    run = Runner(prog)
    p7a, p7b = prompt(70, 7), prompt(71, 7)
    a, b, c = run.open(p7a), run.open(p7b), run.open(prompt(9, 9)[:8])
    for s in (a, b, c):
        run.prefill(s)
    assert prog.capacity().free_pages == 0
    c_pages = prog.kv.table(c)
    ok = prog.reserve_units({a: 1, b: 1, c: 1})
    assert ok == {a: True, b: True, c: False}
    assert prog.kv.table(c) == c_pages                 # the refused row keeps what it had
    out = run.unit(decode=[a, b])
    for s, p in ((a, p7a), (b, p7b)):
        assert [prog.ledger(s)[7], out[s]] == Runner(make_program(dense)).generate(p, 2)
    # a's release frees 2 pages: asking c for 3 new pages is refused atomically (nothing taken),
    # then one page is granted and c continues exactly like an unconstrained run.
    prog.release(a)
    assert prog.capacity().free_pages == 2
    assert prog.reserve_units({c: 9}) == {c: False}
    assert prog.capacity().free_pages == 2 and prog.kv.table(c) == c_pages
    assert prog.reserve_units({c: 1})[c]
    first = prog.ledger(c)[8]
    nxt = run.unit(decode=[c])[c]
    ref = Runner(make_program(dense)).generate(prompt(9, 9)[:8], 2)
    assert [first, nxt] == ref


def test_pause_replay_continue_gives_the_same_greedy_tokens(dense, baseline):
    ids = prompt(14, 14)
    ref_toks = baseline[14][0]
    prog = make_program(dense, max_sequences=2)
    run = Runner(prog)
    s = run.open(ids)
    toks = [run.prefill(s)]
    for _ in range(4):
        toks.append(run.unit(decode=[s])[s])
    state = prog.pause(s)
    assert list(state.ledger) == ids + toks
    # Another sequence takes the freed slot and pages before the resume.
    other = run.open(prompt(2, 2))
    run.prefill(other)
    r = run.open(state.ledger, prompt_length=len(ids))
    assert run.prefill(r, chunks=[6, len(state.ledger) - 1 - 6]) is None   # Replay stops one short
    assert prog.computed(r) == prog.ledger_length(r) - 1
    while len(toks) < STEPS:
        toks.append(run.unit(decode=[r, other])[r])
    assert toks == ref_toks


def test_seeded_sampling_with_penalties_is_batch_and_replay_invariant(dense):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.3, seed=1234, logprobs=True, top_logprobs=3)

    def rs(step):
        return RowSampling(params, seed=1234, step=step)

    ids = prompt(9, 9)
    alone = Runner(make_program(dense))
    s = alone.open(ids)
    ref = [alone.unit(chunk=(s, 9), sampling={s: rs(0)})[s]]
    for i in range(1, 8):
        ref.append(alone.unit(decode=[s], sampling={s: rs(i)})[s])

    prog = make_program(dense)
    run = Runner(prog)
    x, y = run.open(ids), run.open(prompt(5, 5))
    got = [run.unit(chunk=(x, 9), sampling={x: rs(0)})[x]]
    run.prefill(y)
    for i in range(1, 4):
        got.append(run.unit(decode=[x, y], sampling={x: rs(i)})[x])
    r = run.open(prog.pause(x).ledger, prompt_length=9)
    run.prefill(r, chunks=[prog.ledger_length(r) - 1])
    for i in range(4, 8):
        prog.reserve_units({r: 1, y: 1})
        pending = prog.run(ExecutionUnit(decode=(DecodeRow(r, rs(i)), DecodeRow(y, rs(i)))))
        row = pending.row(r)
        lp = row.logprobs[0]
        assert lp.token == row.tokens[0] and len(lp.top) == 3
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= lp.top[0][1] + 1e-6
        prog.commit(pending, {r: 1, y: 1})
        got.append(row.tokens[0])
    assert got == ref
    assert len(set(ref)) > 1


def test_logprobs_are_the_model_distribution(dense):
    prog = make_program(dense)
    run = Runner(prog)
    s = run.open(prompt(5, 5))
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    prog.reserve_units({s: 5})
    pending = prog.run(ExecutionUnit(chunks=(PrefillChunk(s, 5, RowSampling(params, 0, 0)),)))
    logits = run._last[0]
    expect = torch.log_softmax(logits, -1)
    lp = pending.rows[0].logprobs[0]
    assert lp.token == int(logits.argmax()) and abs(lp.logprob - float(expect.max())) < 1e-5
    assert [t for t, _ in lp.top] == torch.topk(expect, 2).indices.tolist()
    prog.commit(pending, {s: 1})


def test_gdn_input_projections_run_as_one_gemm(qwen_case):
    """The converter stores qkv, z, b and a as one parent: each GDN layer projects with one GEMM."""
    from ninfer_qwen3_5.layers.gdn import GatedDeltaNet

    prog = make_program(qwen_case("dense"))
    gdn = [layer.mixer for layer in prog.model.layers if isinstance(layer.mixer, GatedDeltaNet)]
    cfg = prog.cfg
    assert gdn and all(len(m.in_groups) == 1 for m in gdn)
    hv = cfg.linear_num_value_heads
    assert gdn[0].in_groups[0].sizes == (cfg.conv_dim, cfg.value_dim, hv, hv)


def test_attention_input_projections_run_as_one_gemm(qwen_case):
    """The converter stores query, key, value and gate as one parent: each attention layer projects with one
    GEMM, its outputs column views of it in [query | key | value | gate] order."""
    from ninfer_qwen3_5.layers.attention import GatedAttention

    prog = make_program(qwen_case("moe"))
    cfg = prog.cfg
    attn = [layer.mixer for layer in prog.model.layers if isinstance(layer.mixer, GatedAttention)]
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert attn and all(len(m.in_groups) == 1 and m.in_groups[0].sizes == (qd, kd, kd, qd) for m in attn)
