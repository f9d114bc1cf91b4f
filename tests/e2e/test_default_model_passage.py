"""End to end on the embedded default model, anchored on a passage of its training corpus.

``tests/fixtures/default_model_passage.json`` holds a prompt from the training corpus and the corpus
tokens that follow it, which the model reproduces exactly under greedy decoding (chosen by
tools/find_memorized_passage.py; docs/default-model.md says how). The expected tokens come from the
corpus, not from an earlier engine run, so the engine cannot bless its own mistakes. Every way of
running the request (alone, batched with others, any prefill chunk size, preempted and replayed,
through the CLI) must give exactly those tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "default_model_passage.json").read_text())
PROMPT = FIXTURE["prompt_token_ids"]
EXPECTED = FIXTURE["continuation_token_ids"]


def _start(artifact, **options):
    from ninfer import Engine

    return Engine.start(artifact, device="cpu", dtype="float32", **options)


def _greedy(engine):
    return engine.sampling_params(temperature=0.0, max_tokens=len(EXPECTED), ignore_eos=True)


def _others(engine, n: int):
    """Other traffic: text prompts of different lengths, some greedy, some seeded sampling."""
    fe = engine.frontend
    texts = ["import os\n", "class Queue:\n    def put(self, item):", "The quick brown fox",
             "def main(argv=None):\n    parser = argparse.ArgumentParser(", "# Licensed to the PSF under",
             "x = [i * i for i in range(", "try:\n    import _thread\nexcept ImportError:", '"""Utilities for']
    return [(fe.encode(texts[i % len(texts)]),
             engine.sampling_params(temperature=0.0 if i % 2 else 1.0, seed=1000 + i, max_tokens=40,
                                    ignore_eos=True)) for i in range(n)]


def test_fixture_prompt_round_trips_through_the_tokenizer(default_artifact):
    with _start(default_artifact, max_concurrency=1) as engine:
        assert engine.frontend.encode(FIXTURE["prompt_text"]) == PROMPT
        assert engine.frontend.decode(EXPECTED) == FIXTURE["continuation_text"]


def test_alone_reproduces_the_corpus(default_artifact):
    with _start(default_artifact, max_concurrency=1) as engine:
        assert list(engine.generate(PROMPT, sampling=_greedy(engine)).token_ids) == EXPECTED


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_batched_with_seven_others_and_chunked_prefill(default_artifact, chunk):
    with _start(default_artifact, max_concurrency=8, prefill_chunk_size=chunk) as engine:
        others = [engine.submit(p, sampling=s) for p, s in _others(engine, 4)]
        mine = engine.submit(PROMPT, sampling=_greedy(engine))
        others += [engine.submit(p, sampling=s) for p, s in _others(engine, 3)]
        assert list(mine.result().token_ids) == EXPECTED
        for h in others:
            assert h.result().finish_reason == "length"


def test_under_forced_preemption(default_artifact):
    # 8 running requests over a pool of 24 pages of 8 tokens: they cannot all grow, so the youngest are
    # paused (Replay) and resumed while the fixture request runs.
    with _start(default_artifact, max_concurrency=8, prefill_chunk_size=16, page_size=8, num_pages=24,
                max_context=192) as engine:
        handles = [engine.submit(p, sampling=s) for p, s in _others(engine, 4)]
        mine = engine.submit(PROMPT, sampling=_greedy(engine))
        handles += [engine.submit(p, sampling=s) for p, s in _others(engine, 3)]
        assert list(mine.result().token_ids) == EXPECTED
        for h in handles:
            h.result()
        stats = engine.stats()
        assert stats.preemptions > 0, "the pool was meant to force at least one preemption"


def test_others_do_not_change_with_or_without_the_fixture(default_artifact):
    """A seeded sampled request gives the same tokens alone and batched (per-request seeds)."""
    with _start(default_artifact, max_concurrency=1) as engine:
        (prompt, params), = _others(engine, 1)
        alone = list(engine.generate(prompt, sampling=params).token_ids)
    with _start(default_artifact, max_concurrency=8, prefill_chunk_size=5) as engine:
        (prompt, params), = _others(engine, 1)
        mine = engine.submit(PROMPT, sampling=_greedy(engine))
        seeded = engine.submit(prompt, sampling=params)
        assert list(seeded.result().token_ids) == alone
        assert list(mine.result().token_ids) == EXPECTED


def test_cli_reproduces_the_corpus(default_artifact):
    env = dict(os.environ, NINFER_CACHE_DIR=str(default_artifact.parent.parent))
    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "generate", "--prompt", FIXTURE["prompt_text"],
                          "--temperature", "0", "--max-tokens", str(len(EXPECTED)), "--ignore-eos", "--quiet",
                          "--dtype", "float32"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == FIXTURE["continuation_text"] + "\n"


def test_a_top_k_beyond_the_vocabulary_is_no_top_k(default_artifact):
    """top_k at or past the vocabulary keeps every token, like 0: the same seeded tokens, for values up to 2**70
    (2**63 once failed the engine worker converting it to int64; every later request then got 503)."""
    with _start(default_artifact) as engine:
        prompt = engine.frontend.encode("def main(argv=None):")
        runs = [engine.generate(prompt, sampling=engine.sampling_params(temperature=1.0, top_k=k, seed=5,
                                                                         max_tokens=12, ignore_eos=True))
                for k in (0, engine.vocab_size, 2**31, 2**63, 2**70)]
        tokens = [r.token_ids for r in runs]
        assert all(t == tokens[0] for t in tokens), tokens
        assert engine.generate(prompt, sampling=_greedy(engine)).token_ids   # the engine still serves
