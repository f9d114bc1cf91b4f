"""The Qwen4-Exp model on its own Triton kernels (``ninfer_qwen4exp.ops.triton``: QSA, the per-stream and sigmoid-gated
norms, the hyper-connections' mixing and write; every other op the torch references) against transformers, fp32 (on
the CPU under TRITON_INTERPRET=1).

The op suites (test_qsa_triton.py, test_qwen4exp_hc_norm_triton.py) check each kernel alone; this checks them in the
model: QSA on the side pools the model writes, across chunk boundaries that cut QSA blocks and on decode rows, in
the cases whose budgets make long prompts sparse (``sparse``: blocks of 2, 2 kept, PLE and sigmoid-gated GDN;
``plain``: blocks of 4, 3 kept). Criteria: the oracle suite's
(tests/models/qwen4exp/test_qwen4exp_oracle.py): logits of every position within ``5e-4 + 1e-4 |ref|`` of
transformers', whole and in chunks of 3, and transformers' greedy tokens. Slow (~45 s interpreted):
NINFER_RUN_SLOW=1 runs it; on a GPU the Engine test (tests/engine/test_qwen4exp_gpu.py) runs the same kernels
compiled.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers.models.qwen4_exp")

from models.qwen4exp import harness as H  # noqa: E402

from .conftest import CUDA, DEVICE  # noqa: E402

ATOL, RTOL = 5e-4, 1e-4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return H.Cases(tmp_path_factory.mktemp("qwen4exp_triton"))


def _ops():
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry
    from ninfer_qwen4exp.ops.registration import triton_op_impls

    kernels = triton_op_impls()
    if not CUDA:
        kernels = [dataclasses.replace(k, devices=frozenset({"cpu"})) for k in kernels]
    reference = [i for i in get_registry().ops if i.priority == 0]
    return resolve_ops(reference + kernels, DEVICE if CUDA else "cpu", torch.float32, force="")


def _program(c):
    program = H.make_program(c, ops=_ops())
    described = program.model.ops.describe()
    mine = ("qsa_select", "qsa_attention", "rms_norm_unit_offset_grouped", "gated_rms_norm_sigmoid", "hc_mix",
            "hc_write")
    assert all(described[op] == "triton" for op in mine), described
    return program


def _close(ours, ref, what):
    err = (ours - ref).abs()
    assert torch.all(err <= ATOL + RTOL * ref.abs()), f"{what}: max err {err.max().item():.3e}"


@pytest.mark.slow_interpreted
@pytest.mark.skipif(CUDA, reason="the CPU Program with the kernels interpreted; the GPU lane runs the engine")
@pytest.mark.parametrize("name", ["sparse", "plain"])
@pytest.mark.parametrize("chunks", [None, 3])
def test_logits_on_the_kernels_match_transformers(case, name, chunks):
    c = case(name)
    ids = H.prompt(seed=5, length=40, eos_every=13)
    sizes = [len(ids)] if chunks is None else [min(chunks, len(ids) - i) for i in range(0, len(ids), chunks)]
    program = _program(c)
    H.Runner(program)
    seq = program.open_sequence(ids)
    out = []
    for n in sizes:
        assert program.reserve_units({seq: n})[seq]
        out.append(program.score_chunk(seq, n))
    _close(torch.cat(out).float(), H.hf_logits(c, ids), f"{name} chunks {chunks}")


@pytest.mark.slow_interpreted
@pytest.mark.skipif(CUDA, reason="the CPU Program with the kernels interpreted; the GPU lane runs the engine")
@pytest.mark.parametrize("name", ["sparse", "plain"])
def test_greedy_decode_on_the_kernels_matches_transformers(case, name):
    c = case(name)
    ids = H.prompt(seed=9, length=17, eos_every=7)
    run = H.Runner(_program(c))
    seq = run.p.open_sequence(ids)
    run.unit(chunks=[(seq, 6)])
    tokens = [run.unit(chunks=[(seq, len(ids) - 6)])[seq]]
    while len(tokens) < 24:
        tokens.append(run.unit(decode=[seq])[seq])
    ref = H.hf_logits(c, ids + tokens)[len(ids) - 1:-1]
    assert tokens == ref.argmax(dim=-1).tolist(), f"{name}: greedy tokens differ from transformers'"
    _close(torch.stack(run.logits[seq]).float(), ref, f"{name} decode")
