"""Qwen4-Exp MTP speculation through ``Program.run`` / ``commit`` with forced drafts (CPU, fp32 reference ops).

The MTP head drafts as usual (its layer runs and writes its K/V), then a test double replaces its tokens: all correct
(forced acceptance: the plain greedy continuation), all wrong (forced rejection) or a correct prefix then a wrong
token (partial acceptance), in a fixed rotation over the steps. The committed tokens must be plain greedy's, and after
the last commit every piece of the sequence's state must be what a never-drafted run leaves at the same position:
the StateImage (GDN conv and recurrent states, each PLE layer's conv history, the n-gram context) and the paged KV
of every text pool (QSA K/V and the indexer's keys and angles) over the committed positions. A verify runs its
projections with another GEMM row count than a one-row decode step, so states compare within ``TOL``; a wrong
snapshot or a leaked draft moves them by O(0.1)."""

from __future__ import annotations

import pytest
import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.architecture import ProgramInit, ProgramOptions
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry
from ninfer.testing import convert_checkpoint
from ninfer_qwen3_5.speculative_decode import Drafts
from ninfer_qwen4exp.parameters import mtp_parameter_specs

from .harness import GREEDY, VOCAB, prompt
from .test_qwen4exp_mtp_head import _checkpoint

TOL = 1e-4
STEPS = 20


@pytest.fixture(scope="module", params=["sparse", "plain"])
def world(request, tmp_path_factory):
    pytest.importorskip("transformers.models.qwen4_exp")
    root = tmp_path_factory.mktemp(f"q4x-mtp-program-{request.param}")
    _, _, src = _checkpoint(root, request.param)
    artifact = convert_checkpoint(src, root / "model.ninfer")
    with ArtifactReader.open(artifact) as reader:
        config = reader.component("text").config
        spec = get_registry().architecture(config["architectures"][0])
        weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures(speculative="mtp")), "cpu")
    assert any(n.startswith("mtp/") for n in weights)
    assert {s.name for s in mtp_parameter_specs(config)} <= set(weights)
    return config, spec, weights


def program(world, k: int):
    config, spec, weights = world
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=2, page_size=4,
                             num_pages=96, max_context=384, speculative_tokens=k)
    features = StartupFeatures(speculative="mtp" if k else None)
    return spec.create_program(ProgramInit(config=config, weights=weights, ops=ops, options=options,
                                           features=features))


def prefill(prog, tokens: list[int], chunk: int) -> int:
    seq = prog.open_sequence(tokens)
    done = 0
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert all(prog.reserve_units({seq: n}).values())
        last = done + n == len(tokens)
        pending = prog.run(ExecutionUnit(chunks=(PrefillChunk(seq, n, GREEDY if last else None),)))
        prog.commit(pending, {r.seq: len(r.tokens) for r in pending.rows})
        done += n
    return seq


def plain_run(world, tokens: list[int]):
    prog = program(world, 0)
    seq = prefill(prog, tokens, 7)
    while prog.ledger_length(seq) < len(tokens) + STEPS:
        assert all(prog.reserve_units({seq: 1}).values())
        pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, GREEDY),)))
        prog.commit(pending, {r.seq: len(r.tokens) for r in pending.rows})
    return prog, seq


def forced(prog, reference: list[int], k: int):
    """Wrap the drafter: the MTP head runs, then its tokens are replaced by the rotation's (module docstring)."""
    spec = prog.speculation
    real = spec.draft
    calls = [0]

    def draft(verify, masks):
        real(verify, masks)
        out = []
        for row, n in verify:
            at = prog.ledger_length(row.seq)
            right = reference[at:at + n]
            mode = calls[0] % 3
            if mode == 1:      # all wrong
                toks = [(t + 1) % VOCAB for t in right]
            elif mode == 2:    # the first n // 2 right, then wrong
                m = n // 2
                toks = right[:m] + [(t + 1) % VOCAB for t in right[m:]]
            else:              # all right
                toks = list(right)
            out.append(toks)
        calls[0] += 1
        return Drafts(out)

    spec.draft = draft


@pytest.mark.parametrize("k", [1, 2, 4])
def test_forced_acceptance_and_rejection_leave_a_never_drafted_state(world, k):
    tokens = prompt(5, 17, eos_every=6)
    ref_prog, ref_seq = plain_run(world, tokens)
    reference = list(ref_prog.ledger(ref_seq))
    prog = program(world, k)
    forced(prog, reference, k)
    seq = prefill(prog, tokens, 5)
    accepted_any = False
    while prog.ledger_length(seq) < len(reference):
        left = len(reference) - prog.ledger_length(seq)
        n = min(k, left - 1)
        assert all(prog.reserve_units({seq: n + 1}).values())
        pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, GREEDY, drafts=n),)))
        (row,) = pending.rows
        a = min(len(row.tokens), left)
        accepted_any |= a > 1
        prog.commit(pending, {seq: a})
    assert list(prog.ledger(seq)) == reference
    assert accepted_any and prog.speculation_stats.accepted > 0
    assert prog.computed(seq) == ref_prog.computed(ref_seq)
    for f in prog.layout.state.fields:
        got = prog.states.field(f.name)[prog.state_slot(seq)]
        want = ref_prog.states.field(f.name)[ref_prog.state_slot(ref_seq)]
        if f.dtype == torch.int64:
            assert torch.equal(got, want), f.name
        else:
            assert (got - want).abs().max() <= TOL, f.name
    c = prog.computed(seq)
    got_slots = torch.tensor(prog.kv.slot_mapping(seq, 0, c))
    want_slots = torch.tensor(ref_prog.kv.slot_mapping(ref_seq, 0, c))
    for key in ref_prog.kv._pools:
        for g, w in zip(prog.kv.pools(key), ref_prog.kv.pools(key), strict=True):
            g = g.reshape(-1, *g.shape[2:])[got_slots]
            w = w.reshape(-1, *w.shape[2:])[want_slots]
            assert (g - w).abs().max() <= TOL, key


def test_qwen4exp_program_refuses_other_backends(world):
    config, spec, weights = world
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=2, page_size=4,
                             num_pages=32, max_context=128, speculative_tokens=2)
    with pytest.raises(Exception, match="dflash"):
        spec.create_program(ProgramInit(config=config, weights=weights, ops=ops, options=options,
                                        features=StartupFeatures(speculative="dflash")))


def test_profile_counts_the_mtp_pools_and_weights(world):
    config, spec, weights = world
    prog = program(world, 2)
    with_mtp = spec.profile(config, StartupFeatures(speculative="mtp"), dtype=torch.float32)
    without = spec.profile(config, StartupFeatures(), dtype=torch.float32)
    assert with_mtp.kv_bytes_per_token == prog.kv.bytes_per_token > without.kv_bytes_per_token
    mtp_bytes = sum(w.numel() * w.element_size() for n, w in weights.items() if n.startswith("mtp/"))
    assert with_mtp.weight_bytes - without.weight_bytes > mtp_bytes
