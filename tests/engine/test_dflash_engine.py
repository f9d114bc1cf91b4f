"""DFlash / DFlash2 speculative decoding through the public Engine, CPU fp32 reference ops.

The contract, as for MTP: ``speculative="dflash"`` / ``"dflash2"`` changes how many tokens a step commits, never
which. Greedy requests give exactly the tokens of the same engine without speculation at blocks of 4, 8 and 16
(``num_speculative_tokens`` 3, 7, 15; by default the drafter's own block), alone and batched with seven others
(chunked prefill, forced preemption with Replay, context-cache hits); DFlash's drafts are greedy, so seeded
requests are token-exact too. World: the embedded default model with a random drafter of each generation in the
z-lab format (``support.dflash``) added by the converter's ``--draft``; the DFlash2 one has a sliding window
shorter than the longer prompts. Random drafters are seldom right: that multi-token commits stay exact is the
Program tests' (test_dflash_program, whose drafts are made right on purpose).
"""

from __future__ import annotations

import random

import pytest
from ninfer import Engine
from ninfer.artifact.errors import MissingComponentError
from ninfer.contracts.sampling import SamplingParams
from ninfer.errors import NotSupportedError
from support.dflash import write_dflash_drafter

from .streams import check_stream
from .test_speculative_engine import CODE, GREEDY, SEEDED, start

DRAFT = dict(hidden_size=256, vocab_size=6144, num_target_layers=8, target_layer_ids=[1, 3, 5], block_size=16,
             mask_token_id=6143, head_dim=32, heads=4, kv_heads=2, intermediate=256, selector_rank=16,
             selector_top_k=8)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict:
    """The default model with a random drafter of each generation: backend name -> artifact."""
    from ninfer.conversion import convert
    from ninfer.plugins import get_registry

    root = tmp_path_factory.mktemp("dflash_engine")
    folder = get_registry().default_models["qwen3_5-stdlib"].source
    out = {}
    for backend, extra in (("dflash", dict(generation=1)), ("dflash2", dict(generation=2, sliding_window=24))):
        write_dflash_drafter(root / backend, seed=51, **DRAFT, **extra)
        out[backend] = convert(folder, root / f"{backend}.ninfer", progress=False, draft=root / backend).paths[0]
    return out


def run_all(engine: Engine, prompts, sampling) -> list[tuple[int, ...]]:
    handles = [engine.submit(p, sampling=sampling) for p in prompts]
    return [check_stream(list(h), started=True).token_ids for h in handles]


@pytest.fixture(scope="module")
def plain(plain_code):
    """Every CODE prompt alone without speculation, on the default model (conftest's, shared with
    test_speculative_engine): a drafter's artifact has the default model as its text part, so its plain tokens
    must be these."""
    return plain_code


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
@pytest.mark.parametrize("k", [3, 7, None])   # blocks of 4, 8 and the checkpoint's 16
def test_greedy_alone_equals_plain(artifacts, plain, backend, k):
    with start(artifacts[backend], max_concurrency=1, speculative=backend, num_speculative_tokens=k) as engine:
        assert engine.options.num_speculative_tokens == (k or DRAFT["block_size"] - 1)
        got = [engine.generate(p, sampling=GREEDY).token_ids for p in CODE[:3]]
        stats = engine.stats()
    assert got == plain["greedy"][:3]
    assert stats.spec_verifies > 0 and stats.spec_drafted > 0
    assert len(stats.spec_drafted_by_position) <= (k or 15)
    assert stats.spec_drafted_by_position[0] == stats.spec_verifies
    assert sum(stats.spec_drafted_by_position) == stats.spec_drafted


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_batched_and_chunked_equal_plain(artifacts, plain, backend):
    with start(artifacts[backend], max_concurrency=8, prefill_chunk_size=5, speculative=backend,
               num_speculative_tokens=7) as engine:
        assert run_all(engine, CODE, GREEDY) == plain["greedy"]
        if backend == "dflash":   # greedy drafts: seeded sampling is token-exact
            assert run_all(engine, CODE, SEEDED) == plain["seeded"]


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_forced_preemption_equals_plain(artifacts, plain, backend):
    with start(artifacts[backend], max_concurrency=8, prefill_chunk_size=5, num_pages=48, speculative=backend,
               num_speculative_tokens=15) as engine:
        assert run_all(engine, CODE, GREEDY) == plain["greedy"]
        assert engine.stats().preemptions > 0


def _two_turns(engine: Engine) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    rng = random.Random(3)
    turn1 = [rng.randrange(0, 2000) for _ in range(60)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    r1 = engine.generate(turn1, sampling=sp)
    turn2 = turn1 + list(r1.token_ids) + [rng.randrange(0, 2000) for _ in range(9)]
    r2 = engine.generate(turn2, sampling=sp)
    return r1.token_ids, r2.token_ids, engine.stats().cache_hit_tokens


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_context_cache_hit_equals_plain(artifacts, backend):
    options = dict(max_concurrency=2, context_cache=True, cache_checkpoint_interval=16)
    with start(artifacts[backend], **options) as engine:
        want = _two_turns(engine)
    with start(artifacts[backend], **options, speculative=backend, num_speculative_tokens=7) as engine:
        got = _two_turns(engine)
        assert engine.stats().spec_drafted > 0
    assert got == want and want[2] == 60 + 12 - 1


def test_the_backend_needs_its_drafter(artifacts, default_artifact):
    with pytest.raises(MissingComponentError, match=r"speculative='dflash' \(--speculative dflash\) needs the "
                                                    r"artifact component 'dflash'.*--draft"):
        start(default_artifact, speculative="dflash")
    with pytest.raises(NotSupportedError, match="DFlashDraftModel \\(use --speculative dflash\\)"):
        start(artifacts["dflash"], speculative="dflash2")


# -- constrained rows ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_constrained_rows_validate_and_equal_plain(artifacts, backend):
    """A JSON schema, a regex and a GBNF grammar, greedy (and seeded for DFlash, whose drafts are greedy), batched
    with unconstrained rows: every constrained output validates and equals the plain engine's token for token."""
    from .test_speculative_constrained_engine import CONSTRAINTS, PROMPTS, Req, seeded, validates
    from .test_speculative_constrained_engine import GREEDY as LONG

    reqs = [Req(kind, p, LONG) for kind in CONSTRAINTS for p in PROMPTS[:2]] + [Req(None, CODE[0], GREEDY)]
    if backend == "dflash":
        reqs += [Req(kind, PROMPTS[0], seeded(s)) for kind in CONSTRAINTS for s in range(2)]

    def results(engine):
        handles = [engine.submit(r.prompt, sampling=r.sampling, output=r.output) for r in reqs]
        return [(res.token_ids, res.finish_reason, res.output.content) for res in (h.result() for h in handles)]

    with start(artifacts[backend], max_concurrency=8) as engine:
        want = results(engine)
    with start(artifacts[backend], max_concurrency=8, speculative=backend, num_speculative_tokens=7) as engine:
        got = results(engine)
        assert engine.stats().spec_drafted > 0
    assert got == want
    finished = [(r.kind, text) for r, (_, reason, text) in zip(reqs, got, strict=True)
                if r.kind is not None and reason == "stop"]
    assert len(finished) >= len(CONSTRAINTS)
    assert all(validates(kind, text) for kind, text in finished)
