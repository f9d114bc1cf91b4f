"""Qwen4-Exp through the Engine on CUDA (issue 35 item 4): the QSA ops on their Triton kernels, decode CUDA graphs with
each PLE layer's host-table gather as a host step, against transformers' ``Qwen4ExpForCausalLM`` (tiny random
models of tests/models/qwen4exp whose budgets make long prompts sparse: ``sparse`` keeps 2 blocks of 2 tokens,
``plain`` 3 blocks of 4).

- fp32: every request's greedy tokens are transformers' (teacher-forced argmax) with graphs and without
  (``NINFER_CUDA_GRAPHS=0``), and the two runs give the same tokens; a batch of 8 with chunked prefill equals each
  request alone.
- bf16 (``sparse``): the oracle of test_bf16_oracle_gpu.py, per position: the chosen token's logprob against
  transformers' fp32 logprob, on average at most twice transformers' own bf16 forward's error plus 0.01 nats, and
  per position within 1 nat except a few routing or selection flips (never past 3 nats). ``plain`` is left out:
  it keeps 3 of ~30 blocks whose scores are near ties, so bf16 rounding flips a selection (a jump of 1-4 nats at a
  run of positions) in transformers' own bf16 forward as in ours (measured on the CPU reference ops: with the
  selection forced dense, both stay within 1 nat).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from ninfer import Engine, EngineOptions
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.sampling import SamplingParams

pytestmark = pytest.mark.gpu

CASES = ("sparse", "plain")
STEPS = 24
PER_POSITION, HARD_BOUND, OUTLIERS = 1.0, 3.0, 0.05


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    pytest.importorskip("transformers.models.qwen4_exp")
    from models.qwen4exp.harness import Cases

    return Cases(tmp_path_factory.mktemp("qwen4exp_gpu"))


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    from models.qwen4exp.harness import EOS

    out = []
    for n in (9, 40, 61, 120, 23, 77, 50, 33):
        p = [rng.randrange(0, 256) for _ in range(n)]
        for i in range(rng.randrange(5, 13), n, 17):   # EOS inside: the n-gram windows restart there
            p[i] = EOS
        out.append(p)
    return out


def _engine(artifact, dtype: str, **options) -> Engine:
    return Engine.start(artifact, EngineOptions(device="cuda", dtype=dtype, max_context=512, page_size=16,
                                                **options))


def _generate(engine: Engine, prompts, logprobs: bool = False):
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=logprobs)
    runs = []
    handles = [engine.submit(p, sampling=params) for p in prompts]
    for h in handles:
        tokens, lps = [], []
        with h:
            for event in h:
                if isinstance(event, GenerationDelta) and event.token_ids:
                    tokens += event.token_ids
                    lps += [lp.logprob for lp in (event.logprobs or [])]
        runs.append((tokens, lps))
    return runs


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float(), -1)


@pytest.mark.parametrize("name", CASES)
def test_fp32_tokens_are_transformers_with_and_without_graphs(cases, name, monkeypatch):
    case = cases(name)
    prompts = _prompts(3)
    with _engine(case.artifact, "float32", max_concurrency=1, prefill_chunk_size=128) as engine:
        assert engine.info["cuda_graphs"], engine.info
        ops = engine.info["ops"]
        assert ops["qsa_select"] == ops["qsa_attention"] == "triton", ops
        graphed = [engine.generate(p, sampling=SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
                   .token_ids for p in prompts]
    monkeypatch.setenv("NINFER_CUDA_GRAPHS", "0")
    with _engine(case.artifact, "float32", max_concurrency=8, prefill_chunk_size=16) as engine:
        assert not engine.info["cuda_graphs"]
        eager = [tuple(t) for t, _ in _generate(engine, prompts)]
    assert [tuple(t) for t in graphed] == eager, f"{name}: graphs and eager batched runs differ"
    hf = copy.deepcopy(case.hf).to("cuda")
    for prompt, out in zip(prompts, graphed, strict=True):
        ref = _hf_logprobs(hf, prompt + list(out))[len(prompt) - 1:-1].argmax(-1).tolist()
        assert list(out) == ref, f"{name}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("name", ["sparse"])
def test_bf16_logprobs_against_transformers_fp32(cases, name):
    case = cases(name)
    prompts = _prompts(5)
    with _engine(case.artifact, "bfloat16", max_concurrency=4, prefill_chunk_size=64) as engine:
        assert engine.info["dtype"] == "bfloat16" and engine.info["cuda_graphs"]
        runs = _generate(engine, prompts, logprobs=True)
    hf = copy.deepcopy(case.hf).to("cuda")
    hf16 = copy.deepcopy(case.hf).to("cuda", torch.bfloat16)   # a copy: rounding hf's own weights would move the oracle
    ours_err, theirs_err = [], []
    for prompt, (tokens, lps) in zip(prompts, runs, strict=True):
        assert len(tokens) == len(lps) == STEPS
        ids = prompt + tokens[:-1]
        ref = _hf_logprobs(hf, ids)[len(prompt) - 1:]
        ref16 = _hf_logprobs(hf16, ids)[len(prompt) - 1:]
        chosen = torch.tensor(tokens, device="cuda")[:, None]
        ref_chosen = ref.gather(1, chosen)[:, 0]
        err = (torch.tensor(lps, device="cuda") - ref_chosen).abs()
        gap = ref.max(-1).values - ref_chosen
        for what, value in (("logprob error", err), ("fp32 gap to the argmax", gap)):
            over = value.gt(PER_POSITION).nonzero().flatten().tolist()
            assert len(over) <= int(OUTLIERS * STEPS), f"{name}, prompt {len(prompt)}: {what} over 1 nat at {over}"
            assert (value <= HARD_BOUND).all(), f"{name}, prompt {len(prompt)}: {what} {value.max():.3f}"
        ours_err.append(err)
        theirs_err.append((ref16.gather(1, chosen)[:, 0] - ref_chosen).abs())
    ours, theirs = torch.cat(ours_err).mean().item(), torch.cat(theirs_err).mean().item()
    print(f"\n{name}: mean |dlogprob| ours {ours:.4f}, transformers bf16 {theirs:.4f}")
    assert ours <= 2 * theirs + 0.01
