"""MTP speculative decoding through the public Engine, CPU fp32 reference ops.

The contract: ``speculative="mtp"`` changes how many tokens a step commits, never which. Greedy and seeded
requests give exactly the tokens of the same engine without speculation, alone and batched (mixed prompt
lengths, chunked prefill, forced preemption with Replay, context-cache hits), with stop strings and
``max_tokens`` cutting inside a verify; a constrained (JSON) request and one asking for logprobs beside the
other speculating rows (test_speculative_constrained_engine checks those in depth). Worlds: the embedded default model (its trained MTP head, which accepts
often, so multi-token commits are exercised) and a tiny random dense model given a random MTP head.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from ninfer import Engine, EngineOptions
from ninfer.artifact.errors import MissingComponentError
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.sampling import SamplingParams

from .streams import check_stream

CODE = ["import os\nimport sys\n\n\ndef main():\n", "class Queue:\n    def __init__(self, maxsize=0):\n",
        "# file: Lib/json/__init__.py\n", "def join(a, *p):\n    \"\"\"Join two or more pathname components",
        "import re\n", "from collections import", "    for i in range(len(", "x = {\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=7)


def start(artifact, **options) -> Engine:
    options.setdefault("device", "cpu")
    options.setdefault("dtype", "float32")
    options.setdefault("max_context", 160)
    options.setdefault("page_size", 4)
    return Engine.start(artifact, EngineOptions(**options))


def run_all(engine: Engine, prompts, sampling) -> list[tuple[int, ...]]:
    handles = [engine.submit(p, sampling=sampling) for p in prompts]
    return [check_stream(list(h), started=True).token_ids for h in handles]


@pytest.fixture(scope="module")
def plain(plain_code):
    """Every CODE prompt alone without speculation: greedy and seeded token ids (conftest's, shared with
    test_dflash_engine)."""
    return plain_code


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_alone_equals_plain(default_artifact, plain, k):
    with start(default_artifact, max_concurrency=1, speculative="mtp", num_speculative_tokens=k) as engine:
        assert engine.options.num_speculative_tokens == k
        got = [engine.generate(p, sampling=GREEDY).token_ids for p in CODE]
        stats = engine.stats()
    assert got == plain["greedy"]
    # The trained head drafts and is right often: multi-token commits really happened.
    assert stats.spec_verifies > 0 and stats.spec_drafted > 0 and stats.spec_accepted > 0
    assert stats.spec_drafted <= k * stats.spec_verifies and stats.spec_accepted <= stats.spec_drafted
    assert stats.units < stats.completion_tokens


@pytest.mark.parametrize("chunk", [5, 64])
def test_batched_and_chunked_equal_plain(default_artifact, plain, chunk):
    with start(default_artifact, max_concurrency=8, prefill_chunk_size=chunk, speculative="mtp") as engine:
        assert engine.options.num_speculative_tokens == 3   # the default
        assert run_all(engine, CODE, GREEDY) == plain["greedy"]
        assert run_all(engine, CODE, SEEDED) == plain["seeded"]
        assert engine.stats().spec_accepted > 0


def test_seeded_alone_equals_plain(default_artifact, plain):
    with start(default_artifact, max_concurrency=1, speculative="mtp", num_speculative_tokens=2) as engine:
        assert [engine.generate(p, sampling=SEEDED).token_ids for p in CODE] == plain["seeded"]


def test_forced_preemption_equals_plain(default_artifact, plain):
    # 48 pages of 4 tokens: one max_context request and a little more, far less than 8 running requests need.
    with start(default_artifact, max_concurrency=8, prefill_chunk_size=5, num_pages=48, speculative="mtp",
               num_speculative_tokens=4) as engine:
        assert run_all(engine, CODE, GREEDY) == plain["greedy"]
        stats = engine.stats()
    assert stats.preemptions > 0 and stats.spec_accepted > 0


def _two_turns(engine: Engine) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A first turn, then a second whose prompt extends the first's prompt and answer: (answer 1, answer 2,
    the prompt tokens the second turn's checkpoint covered)."""
    rng = random.Random(3)
    turn1 = [rng.randrange(0, 2000) for _ in range(60)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    r1 = engine.generate(turn1, sampling=sp)
    turn2 = turn1 + list(r1.token_ids) + [rng.randrange(0, 2000) for _ in range(9)]
    r2 = engine.generate(turn2, sampling=sp)
    return r1.token_ids, r2.token_ids, engine.stats().cache_hit_tokens


def test_context_cache_hit_equals_plain(default_artifact):
    """Checkpoints see committed positions only: the response-end checkpoint covers prompt and answer less its
    last token, as without speculation, and the second turn's tokens are the plain ones."""
    options = dict(max_concurrency=2, context_cache=True, cache_checkpoint_interval=16)
    with start(default_artifact, **options) as engine:
        want = _two_turns(engine)
    with start(default_artifact, **options, speculative="mtp", num_speculative_tokens=4) as engine:
        got = _two_turns(engine)
        assert engine.stats().spec_drafted > 0
    assert got == want and want[2] == 60 + 12 - 1


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 7, 11])
def test_max_tokens_cut_inside_a_verify(default_artifact, max_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results = []
    for spec in ({}, {"speculative": "mtp", "num_speculative_tokens": 4}):
        with start(default_artifact, max_concurrency=8, **spec) as engine:
            handles = [engine.submit(p, sampling=sp) for p in CODE]
            results.append([(r.token_ids, r.finish_reason) for r in (h.result() for h in handles)])
    assert results[0] == results[1]
    assert any(reason == "length" and len(t) == max_tokens for t, reason in results[1])


def test_stop_strings_inside_a_verify(default_artifact):
    prompt = CODE[0]
    with start(default_artifact, max_concurrency=1) as engine:
        text = engine.generate(prompt, sampling=GREEDY).output.content
        stops = [text[i:i + 3] for i in (4, 9, 17) if text[i:i + 3].strip()]
        assert stops
        want = [engine.generate(prompt, sampling=GREEDY, output=OutputOptions(stop=(s,))) for s in stops]
    with start(default_artifact, max_concurrency=4, speculative="mtp", num_speculative_tokens=4) as engine:
        handles = [engine.submit(prompt, sampling=GREEDY, output=OutputOptions(stop=(s,))) for s in stops]
        got = [h.result() for h in handles]
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.output.content, g.finish_reason, g.stop_reason) == (
            w.token_ids, w.output.content, w.finish_reason, w.stop_reason)
        assert g.finish_reason == "stop"


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def test_constrained_and_logprob_rows_beside_speculating_rows(default_artifact, plain):
    json_sp = SamplingParams(temperature=1.0, max_tokens=64, seed=3)
    lp_sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=True, top_logprobs=2)
    json_out = OutputOptions(constraint=OutputConstraint.json_schema(SCHEMA))
    with start(default_artifact, max_concurrency=1) as engine:
        want_json = engine.generate(CODE[2], sampling=json_sp, output=json_out)
        want_lp = engine.generate(CODE[3], sampling=lp_sp)
    with start(default_artifact, max_concurrency=8, speculative="mtp", num_speculative_tokens=3) as engine:
        j = engine.submit(CODE[2], sampling=json_sp, output=json_out)
        lp = engine.submit(CODE[3], sampling=lp_sp)
        others = [engine.submit(p, sampling=GREEDY) for p in CODE]
        got_json, got_lp = j.result(), lp.result()
        assert [h.result().token_ids for h in others] == plain["greedy"]
        assert engine.stats().spec_accepted > 0
    assert got_json.token_ids == want_json.token_ids and got_json.finish_reason == "stop"
    jsonschema.validate(json.loads(got_json.output.content), SCHEMA)
    assert got_lp.token_ids == want_lp.token_ids


def test_an_artifact_without_the_mtp_component_is_refused(tiny_qwen_artifact):
    with pytest.raises(MissingComponentError, match=r"speculative='mtp' \(--speculative mtp\) needs the artifact "
                                                    r"component\(s\) 'mtp'.*it provides: text"):
        start(tiny_qwen_artifact, speculative="mtp")


# -- a tiny random dense model with a random MTP head ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_mtp_artifact(tmp_path_factory):
    from ninfer.conversion import convert
    from support.models import add_mtp_tensors, randomize_weights, tiny_text_model, write_byte_tokenizer

    from tests.models.qwen3_5.test_mtp import TRAIN
    from tests.models.qwen3_5.test_speculative_program import DENSE_TEXT

    root = tmp_path_factory.mktemp("tiny_mtp")
    hf = tiny_text_model("dense", DENSE_TEXT, seed=31, eos_token_id=258)
    hf.config.architectures = ["Qwen3_5ForCausalLM"]
    folder = root / "hf"
    hf.save_pretrained(folder)
    write_byte_tokenizer(folder)
    mtp = TRAIN.build_mtp_class()(hf.config)
    randomize_weights(mtp, 32)
    add_mtp_tensors(folder, mtp.float().eval())
    artifact = root / "tiny.ninfer"
    convert(folder, artifact, progress=False)
    return artifact


def test_tiny_random_model_greedy_and_seeded_equal_plain(tiny_mtp_artifact):
    rng = random.Random(9)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, max_tokens=24, seed=5, presence_penalty=0.3, ignore_eos=True)
    with start(tiny_mtp_artifact, max_concurrency=8, prefill_chunk_size=7) as engine:
        want = run_all(engine, prompts, greedy), run_all(engine, prompts, seeded)
    for k in (1, 4):
        with start(tiny_mtp_artifact, max_concurrency=8, prefill_chunk_size=7, speculative="mtp",
                   num_speculative_tokens=k) as engine:
            assert (run_all(engine, prompts, greedy), run_all(engine, prompts, seeded)) == want
            assert engine.stats().spec_drafted > 0
