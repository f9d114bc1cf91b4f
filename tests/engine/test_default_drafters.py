"""The default model's shipped DFlash and DFlash2 drafters (trained by tools/train_dflash.py).

``Engine.start(None, speculative="dflash")`` resolves the default model converted with its shipped drafter of that
kind (``DefaultModel.drafts``), into an artifact of its own beside the plain one; a backend the model carries
itself (MTP) resolves to the plain artifact. Greedy output with either drafter equals plain decoding's (CPU,
fp32), and the drafters really draft: on held-out standard-library source a verify accepts more than half a draft
on average (random drafters of the same size accept almost none: test_dflash_engine's).
"""

from __future__ import annotations

import pytest
from ninfer import Engine, EngineOptions
from ninfer.artifact import ArtifactReader
from ninfer.contracts.sampling import SamplingParams
from ninfer.model_source import resolve_model
from ninfer.plugins import get_registry

# Held-out modules' source (tools/default_model_corpus.py keeps them out of training).
PROMPTS = ["def _gcd(a, b):\n    # Supports non-integers for backward compatibility.\n",
           "class Fraction(numbers.Rational):\n    \"\"\"This class implements rational numbers.\n",
           "def dedent(text):\n    \"\"\"Remove any common leading whitespace from every line in `text`.\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("drafter-cache")
    monkeypatch_module.setenv("NINFER_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_default_model_ships_both_drafters_within_8_mb():
    model = get_registry().default_models["qwen3_5-stdlib"]
    assert set(model.drafts) == {"dflash", "dflash2"}
    total = sum(f.stat().st_size for d in model.drafts.values() for f in d.iterdir() if f.is_file())
    assert total <= 8 * 2**20


def test_a_drafter_resolves_to_its_own_artifact(cache):
    plain = resolve_model(None, quiet=True)
    assert resolve_model(None, quiet=True, draft="mtp") == plain   # MTP is inside the checkpoint
    assert resolve_model("qwen3_5-stdlib", quiet=True, draft=None) == plain
    with_dflash = resolve_model(None, quiet=True, draft="dflash")
    with_dflash2 = resolve_model("qwen3_5-stdlib", quiet=True, draft="dflash2")
    assert len({plain, with_dflash, with_dflash2}) == 3
    assert resolve_model(None, quiet=True, draft="dflash") == with_dflash   # converted once
    for path, component in ((plain, None), (with_dflash, "dflash"), (with_dflash2, "dflash")):
        with ArtifactReader.open(path) as reader:
            assert reader.directory.metadata["name"] == "qwen3_5-stdlib"
            assert ("dflash" in reader.directory.components) == (component is not None)


def _run(**options) -> tuple[list[tuple[int, ...]], object]:
    opts = EngineOptions(device="cpu", dtype="float32", max_concurrency=4, max_context=256, **options)
    with Engine.start(None, opts) as engine:
        handles = [engine.submit(p, sampling=GREEDY) for p in PROMPTS]
        out = [tuple(h.result().token_ids) for h in handles]
        return out, engine.stats()


@pytest.fixture(scope="module")
def plain(cache):
    return _run()[0]


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_shipped_drafters_are_exact_and_accepted(cache, plain, backend):
    got, stats = _run(speculative=backend)
    assert got == plain
    assert stats.spec_verifies > 0
    assert stats.spec_accepted / stats.spec_verifies > 0.5, (stats.spec_accepted, stats.spec_verifies)
