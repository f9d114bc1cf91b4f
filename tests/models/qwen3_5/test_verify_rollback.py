"""Speculative verify and its commit on the Qwen3.5 Program (CPU, fp32 reference ops;
ninfer_qwen3_5.speculative_state).

A verify row runs ``[t_last, d_1..d_k]`` in one forward (a verify chunk) beside decode rows and prefill
chunks. It must give, at every position, the logits that k+1 plain decode steps fed the same tokens give;
its GDN snapshots must be the states those decode steps leave; the live StateImage must not change until
``select``; and after ``select`` of n accepted inputs the sequence must continue exactly like a run that
never drafted and decoded those n inputs (the rejected drafts' K/V, left in the pages, never read).

The forward is driven directly (``Program.forward`` on hand-built decode rows and chunks at positions the
test tracks), since the engine's speculative units do not exist yet. Comparisons: given the same op
inputs, the GDN verify steps are bit-identical to decode steps (asserted exactly, layer by layer); through
the whole model, logits and states are compared within ``TOL`` (max abs), because a verify forward runs its
projections and MLPs with another GEMM row count than a one-row decode step (on the CPU a one-row linear
takes another kernel, off by ~1e-6) and its attention as a chunk: measured at most 4e-6 on the verify
logits (magnitude ~4), 6e-6 on committed states and 2e-5 on logits five decode steps later; a semantic error
(a wrong snapshot, a leaked draft K/V) moves them by O(0.1). Greedy tokens are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import ChunkRows, DecodeRows, ForwardBatch, pack_batch
from ninfer_qwen3_5.layers.gdn import GatedDeltaNet
from ninfer_qwen3_5.speculative_state import verify_chunk_rows

from .harness import Runner, make_program, prompt

TOL = 1e-4
MAX_INPUTS = 4   # k <= 3


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request, qwen_case):
    return qwen_case(request.param)


def program(case):
    prog = make_program(case)
    prog.configure_speculation(max_rows=2, max_inputs=MAX_INPUTS)
    return prog


def started(prog, seed: int, length: int) -> tuple[int, int, int]:
    """A sequence prefilled (and committed) through the engine path, with KV reserved for 12 more tokens:
    (seq, position p of its next input, that input t_last)."""
    run = Runner(prog, record=False)
    seq = run.open(prompt(seed, length))
    run.prefill(seq)
    assert all(prog.reserve_units({seq: 12}).values())
    p = prog.computed(seq)
    return seq, p, prog.ledger(seq)[p]


def decode_rows(prog, rows) -> DecodeRows:
    """Plain decode rows ``[(seq, position, token)]``, each reading and writing its live slot."""
    seqs = tuple(s for s, _, _ in rows)
    at = tuple(p for _, p, _ in rows)
    slots = tuple(prog.state_slot(s) for s in seqs)
    return DecodeRows(seqs=seqs, device=prog.device, at=at, state_slots=slots, state_out_slots=slots,
                      kv_slots=tuple(prog.kv.slot_mapping(s, p, p + 1)[0] for s, p in zip(seqs, at, strict=True)),
                      pages=tuple(tuple(r) for r in prog.kv.page_rows(seqs, [p + 1 for p in at])),
                      token_ids=tuple(t for _, _, t in rows))


def decode(prog, rows) -> torch.Tensor:
    return prog.forward(ForwardBatch(decode=decode_rows(prog, rows))).clone()


def prefill_chunk(prog, seq: int, n: int) -> ChunkRows:
    ids = prog.ledger(seq)[:n]
    return ChunkRows(seq=seq, device=prog.device, slot=prog.state_slot(seq), start=0, token_ids=ids,
                     kv_slots=tuple(prog.kv.slot_mapping(seq, 0, n)), pages=tuple(prog.kv.page_rows([seq], [n])[0]),
                     want_logits=True)


def fields(storage, slot: int) -> dict[str, torch.Tensor]:
    return {f.name: storage.field(f.name)[slot].clone() for f in storage.layout.fields}


def max_field_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def same_fields(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def drafts(seed: int, k: int) -> list[int]:
    return prompt(1000 + seed, k)


def test_verify_logits_and_snapshots_equal_successive_decode_steps(case):
    """Two verify rows (k = 3 and k = 1) in one forward with a decode row and a prefill chunk: each verify
    position's logits are those of the plain decode step fed the same token; each snapshot is the state
    that step leaves; the decode row and the chunk are unaffected; the live slots are byte-for-byte
    untouched."""
    ver, ref = program(case), program(case)
    seqs = {}
    for name, prog in (("ver", ver), ("ref", ref)):
        a, pa, ta = started(prog, 1, 7)
        b, pb, tb = started(prog, 2, 5)
        c, pc, tc = started(prog, 3, 9)
        d = prog.open_sequence(prompt(4, 6))
        assert all(prog.reserve_units({d: 6}).values())
        seqs[name] = (a, b, c, d)
    a, b, c, d = seqs["ver"]
    ra, rb, rc, rd = seqs["ref"]
    ins_a = [ver.ledger(a)[-1]] + drafts(1, 3)
    ins_b = [ver.ledger(b)[-1]] + drafts(2, 1)
    pa, pb, pc = ver.computed(a), ver.computed(b), ver.computed(c)
    tc = ver.ledger(c)[-1]

    snaps_a, snaps_b = ver.snapshots.assign([ver.state_slot(a), ver.state_slot(b)], [len(ins_a), len(ins_b)])
    live = {s: ver.states.image(ver.state_slot(s)).clone() for s in (a, b)}
    batch = ForwardBatch(decode=decode_rows(ver, [(c, pc, tc)]),
                         chunks=(verify_chunk_rows(ver, a, pa, ins_a, snaps_a), prefill_chunk(ver, d, 6),
                                 verify_chunk_rows(ver, b, pb, ins_b, snaps_b)))
    assert batch.num_logit_rows == 1 + 4 + 1 + 2
    got = ver.forward(batch).clone()
    for s in (a, b):
        assert torch.equal(ver.states.image(ver.state_slot(s)), live[s]), "verify wrote a live slot"

    # The never-drafted reference: the same tokens one decode step at a time (b stops after 2 steps).
    want_c = decode(ref, [(rc, pc, tc)])[0]
    want_d = ref.forward(ForwardBatch(decode=None, chunks=(prefill_chunk(ref, rd, 6),)))[0].clone()
    want_a, want_b = [], []
    for j in range(len(ins_a)):
        rows = [(ra, pa + j, ins_a[j])] + ([(rb, pb + j, ins_b[j])] if j < len(ins_b) else [])
        out = decode(ref, rows)
        want_a.append(out[0])
        sa, wa = fields(ver.snapshots.storage, snaps_a[j]), fields(ref.states, ref.state_slot(ra))
        assert max_field_diff(sa, wa) <= TOL, f"snapshot {j} of the k = 3 row differs by {max_field_diff(sa, wa)}"
        if j < len(ins_b):
            want_b.append(out[1])
            assert max_field_diff(fields(ver.snapshots.storage, snaps_b[j]), fields(ref.states, ref.state_slot(rb))) <= TOL
    want = torch.stack([want_c, *want_a, want_d, *want_b])
    diff = float((got - want).abs().max())
    assert diff <= TOL, f"verify logits differ from decode steps by {diff}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The decode row and the prefill chunk left the same live states as alone.
    for s, r in ((c, rc), (d, rd)):
        assert max_field_diff(fields(ver.states, ver.state_slot(s)), fields(ref.states, ref.state_slot(r))) <= TOL


def test_gdn_verify_steps_are_bit_identical_to_decode_steps(case):
    """Each GDN layer, fed the same projection outputs: every verify token's output and every snapshot equal,
    bit for bit, those of one-row decode steps from the live state (rows with k = 3 and k = 1 share the
    steps' calls); the live fields are untouched."""
    prog = program(case)
    (a, pa, ta), (b, pb, tb) = started(prog, 1, 7), started(prog, 2, 5)
    ins = {a: [ta] + drafts(1, 3), b: [tb] + drafts(2, 1)}
    snaps = dict(zip((a, b), prog.snapshots.assign([prog.state_slot(a), prog.state_slot(b)],
                                                     [len(ins[a]), len(ins[b])]), strict=True))
    chunks = (verify_chunk_rows(prog, a, pa, ins[a], snaps[a]), verify_chunk_rows(prog, b, pb, ins[b], snaps[b]))
    ctx = prog.step_context(pack_batch(ForwardBatch(decode=None, chunks=chunks), prog.device))
    live = {s: fields(prog.states, prog.state_slot(s)) for s in (a, b)}
    cfg, ops = prog.cfg, prog.ops
    n, hv, dv = 6, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    gen = torch.Generator().manual_seed(3)
    layers = [layer.mixer for layer in prog.model.layers if isinstance(layer.mixer, GatedDeltaNet)]
    for m in layers:
        qkv, z = torch.randn(n, cfg.conv_dim, generator=gen), torch.randn(n, hv, dv, generator=gen)
        ga, gb = torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen)
        conv, rec = prog.states.field(m.conv_name), prog.states.field(m.rec_name)
        o = m._verify(qkv, z, ga, gb, ctx, conv, rec)
        snap_conv, snap_rec = prog.snapshots.storage.field(m.conv_name), prog.snapshots.storage.field(m.rec_name)
        at = 0
        for s in (a, b):
            slot, zero = prog.state_slot(s), torch.zeros(1, dtype=torch.int64)
            c, r = conv[slot:slot + 1].clone(), rec[slot:slot + 1].clone()
            for j, snap in enumerate(snaps[s]):
                i = at + j
                want = ops.gdn_decode(qkv[i:i + 1], z[i:i + 1], ga[i:i + 1], gb[i:i + 1], m.decode_params, c, r,
                                      zero, zero)
                assert torch.equal(o[i], want[0]), f"layer {m.index}, token {j}"
                assert torch.equal(snap_conv[snap], c[0]) and torch.equal(snap_rec[snap], r[0]), \
                    f"layer {m.index}, snapshot {j}"
            at += len(snaps[s])
    for s in (a, b):
        assert same_fields(fields(prog.states, prog.state_slot(s)), live[s])


@pytest.mark.parametrize("accepted", range(MAX_INPUTS + 1))
def test_select_commits_exactly_the_accepted_inputs(case, accepted):
    """Forced acceptance of ``accepted`` of the k + 1 = 4 inputs: the live StateImage after select equals
    that of a run that decoded exactly those inputs, and decoding on from there (over the K/V the rejected
    drafts left in the pages) gives that run's logits step after step."""
    ver, ref = program(case), program(case)
    s, p, t_last = started(ver, 5, 10)
    r, _, _ = started(ref, 5, 10)
    ins = [t_last] + drafts(5, MAX_INPUTS - 1)
    (snaps,) = ver.snapshots.assign([ver.state_slot(s)], [len(ins)])
    logits = ver.forward(ForwardBatch(decode=None, chunks=(verify_chunk_rows(ver, s, p, ins, snaps),))).clone()
    ver.select_snapshot(ver.state_slot(s), accepted)

    for j in range(accepted):
        decode(ref, [(r, p + j, ins[j])])
    diff = max_field_diff(fields(ver.states, ver.state_slot(s)), fields(ref.states, ref.state_slot(r)))
    assert diff <= TOL, f"committed state differs by {diff}"

    # The next input: t_last again when nothing was accepted, else the target's token after the accepted ones.
    nxt = t_last if accepted == 0 else int(logits[accepted - 1].argmax())
    for step in range(5):
        pos = p + accepted + step
        got, want = decode(ver, [(s, pos, nxt)])[0], decode(ref, [(r, pos, nxt)])[0]
        diff = float((got - want).abs().max())
        assert diff <= TOL, f"step {step} after accepting {accepted}: logits differ by {diff}"
        assert int(got.argmax()) == int(want.argmax())
        nxt = int(want.argmax())


def test_select_refuses_what_the_verify_did_not_produce(case):
    prog = program(case)
    s, p, t_last = started(prog, 6, 4)
    slot = prog.state_slot(s)
    with pytest.raises(ProgramError, match="no verify"):
        prog.select_snapshot(slot, 1)
    (snaps,) = prog.snapshots.assign([slot], [2])
    prog.forward(ForwardBatch(decode=None, chunks=(verify_chunk_rows(prog, s, p, [t_last, 7], snaps),)))
    with pytest.raises(ProgramError, match="cannot accept 3"):
        prog.select_snapshot(slot, 3)
    prog.select_snapshot(slot, 2)
    with pytest.raises(ProgramError, match="no verify"):
        prog.select_snapshot(slot, 2)
    with pytest.raises(ProgramError, match="1..4 inputs"):
        prog.snapshots.assign([slot], [5])
    with pytest.raises(ProgramError, match="exceed"):
        prog.snapshots.assign([0, 1, 2], [1, 1, 1])


def test_verify_chunk_needs_configured_speculation(case):
    prog = make_program(case)
    s, p, t_last = started(prog, 7, 4)
    chunk = verify_chunk_rows(prog, s, p, [t_last, 3], (0, 1))
    with pytest.raises(ProgramError, match="configure_speculation"):
        prog.forward(ForwardBatch(decode=None, chunks=(chunk,)))
