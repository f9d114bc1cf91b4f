"""Speculative verify on the Triton ops against the same on the torch reference ops (tiny random Qwen3.5
checkpoints of tests/models/qwen3_5, fp32; on the CPU under TRITON_INTERPRET=1).

The reference suite (tests/models/qwen3_5/test_verify_rollback.py) proves the verify path equals decode
steps; this checks the plumbing only the kernels take: ``gdn_decode`` on gathered verify rows against the
snapshot storage's slots (in place at step 0), the varlen attention over a verify chunk packed with a decode
row and a prefill chunk. Criterion as in test_qwen35_model_triton.py: logits and the snapshots within 1e-4 (max
abs; the kernels reorder fp32 sums), the same greedy tokens after a select.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from models.qwen3_5 import harness as H  # noqa: E402
from ninfer.program.batch import ChunkRows, DecodeRows, ForwardBatch  # noqa: E402
from ninfer_qwen3_5.speculative_state import verify_chunk_rows  # noqa: E402

from .conftest import DEVICE, qwen_program  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def qwen_case(tmp_path_factory):
    return H.Cases(tmp_path_factory.mktemp("qwen3_5_verify_triton"))


def _program(case, ops_kind: str):
    prog = qwen_program(case, ops_kind)
    prog.configure_speculation(max_rows=2, max_inputs=4)
    return prog


def _decode_rows(prog, rows) -> DecodeRows:
    """Plain decode rows ``[(seq, position, token)]``, each reading and writing its live slot."""
    seqs, at = tuple(s for s, _, _ in rows), tuple(p for _, p, _ in rows)
    slots = tuple(prog.state_slot(s) for s in seqs)
    return DecodeRows(seqs=seqs, device=prog.device, at=at, state_slots=slots, state_out_slots=slots,
                      kv_slots=tuple(prog.kv.slot_mapping(s, p, p + 1)[0] for s, p, _ in rows),
                      pages=tuple(tuple(r) for r in prog.kv.page_rows(seqs, [p + 1 for p in at])),
                      token_ids=tuple(t for _, _, t in rows))


def _run(prog) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Verify a (k = 3) and b (k = 1) beside a decode row of c and a prefill chunk of d; select 2 and 1
    accepted inputs; decode a and b three more steps. Returns the logits of each forward and the snapshots."""
    run = H.Runner(prog, record=False)
    a, b, c = run.open(H.prompt(1, 7)), run.open(H.prompt(2, 5)), run.open(H.prompt(3, 9))
    for s in (a, b, c):
        run.prefill(s)
    d = run.open(H.prompt(4, 6))
    assert all(prog.reserve_units({a: 8, b: 8, c: 1, d: 6}).values())
    pos = {s: prog.computed(s) for s in (a, b, c)}
    ins = {a: [prog.ledger(a)[-1], 11, 22, 33], b: [prog.ledger(b)[-1], 44]}
    snaps = dict(zip((a, b), prog.snapshots.assign([prog.state_slot(a), prog.state_slot(b)], [4, 2]), strict=True))
    prefill = ChunkRows(seq=d, device=prog.device, slot=prog.state_slot(d), start=0, token_ids=prog.ledger(d),
                        kv_slots=tuple(prog.kv.slot_mapping(d, 0, 6)), pages=tuple(prog.kv.page_rows([d], [6])[0]),
                        want_logits=True)
    batch = ForwardBatch(decode=_decode_rows(prog, [(c, pos[c], prog.ledger(c)[-1])]),
                         chunks=(verify_chunk_rows(prog, a, pos[a], ins[a], snaps[a]), prefill,
                                 verify_chunk_rows(prog, b, pos[b], ins[b], snaps[b])))
    logits = [prog.forward(batch).float().cpu()]
    storage = prog.snapshots.storage
    snapshots = [torch.cat([storage.field(f.name)[s].float().reshape(-1).cpu() for f in storage.layout.fields])
                 for s in snaps[a] + snaps[b]]
    accepted = {a: 2, b: 1}
    for s, n in accepted.items():
        prog.select_snapshot(prog.state_slot(s), n)
    nxt = {a: int(logits[0][1 + 1].argmax()), b: int(logits[0][1 + 4 + 1].argmax())}
    for step in range(3):
        out = prog.forward(ForwardBatch(decode=_decode_rows(
            prog, [(s, pos[s] + accepted[s] + step, nxt[s]) for s in (a, b)]))).float().cpu()
        logits.append(out)
        nxt = {a: int(out[0].argmax()), b: int(out[1].argmax())}
    return logits, snapshots


# The verify plumbing (GDN layers, attention) is the same in both; only their MLPs differ. Under the
# interpreter each case takes minutes on a 2-core CPU, so the MoE case runs where the kernels compile.
@pytest.mark.slow_interpreted
@pytest.mark.parametrize("name", ["dense", pytest.param("moe", marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="the MoE case runs on a CUDA device (the dense one covers the plumbing here)"))])
def test_verify_on_triton_ops_matches_reference_ops(qwen_case, name):
    case = qwen_case(name)
    triton_program = _program(case, "triton")
    described = triton_program.model.ops.describe()
    for op in ("gdn_decode", "paged_attention", "causal_conv1d_prefill"):
        assert described[op] == "triton", described
    ref_logits, ref_snaps = _run(_program(case, "reference"))
    tri_logits, tri_snaps = _run(triton_program)
    for i, (want, got) in enumerate(zip(ref_snaps, tri_snaps, strict=True)):
        err = (got - want).abs().max().item()
        assert err <= TOL, f"{name}: snapshot {i} differs by {err:.2e}"
    for i, (want, got) in enumerate(zip(ref_logits, tri_logits, strict=True)):
        err = (got - want).abs().max().item()
        assert err <= TOL, f"{name}: forward {i} logits differ by {err:.2e}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
