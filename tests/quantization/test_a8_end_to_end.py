"""A8 end to end on the CPU: ``--quantize fp8+a8`` records AllowA8 on the Uses of the fp8 weights
, ``ninfer info`` shows the policies, the engine binds those weights as A8 and the
A8 reference product runs, and the logits stay near the fp8 A16 and the unquantized fp32 runs."""

from __future__ import annotations

import pytest
import torch
from ninfer import Engine
from ninfer.artifact import ArtifactReader, describe, summarize
from ninfer.conversion import convert
from ninfer.conversion.recipe import RecipeError, load_recipe
from ninfer.ops.reference import a8

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"


def _logprobs(path) -> torch.Tensor:
    with Engine.start(path, device="cpu", dtype="float32", purpose="causal_scoring") as eng:
        rep = eng.score([TEXT], logprobs=True)
    return torch.tensor([t.logprob for t in rep.texts[0].token_logprobs], dtype=torch.float64)


def test_a8_recipe_parsing(tmp_path):
    r = load_recipe("fp8+a8")
    assert r.activations == "a8" and r.rules == load_recipe("fp8").rules
    assert load_recipe("mixed+search+a8").method == "search"
    assert load_recipe("fp8").activations == "a16"
    toml = tmp_path / "r.toml"
    toml.write_text('base = "fp8"\nactivations = "a8"\n')
    assert load_recipe(str(toml)).activations == "a8"
    toml.write_text('base = "fp8"\nactivations = "a4"\n')
    with pytest.raises(RecipeError, match="activations"):
        load_recipe(str(toml))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a8_artifact_runs_the_a8_product(checkpoints, tmp_path, kind, monkeypatch):
    src = checkpoints[kind]
    qa8, qa16, plain = tmp_path / "a8.ninfer", tmp_path / "a16.ninfer", tmp_path / "plain.ninfer"
    convert(src, qa8, progress=False, quantize="fp8+a8")
    convert(src, qa16, progress=False, quantize="fp8")
    convert(src, plain, progress=False)
    with ArtifactReader.open(qa8) as reader:
        policies = summarize(reader)["activation_policies"]
        text = describe(reader)
        uses = {u.parameter: u.activation_policy for u in reader.directory.uses}
    assert policies.get("AllowA8", 0) > 0 and "activation policies (uses): " in text and "AllowA8" in text
    assert uses["text/lm_head"] == "AllowA8"
    if kind == "moe":  # every fp8 weight is allowed A8, expert banks too (the MoE op runs them A16)
        assert uses["text/layers/0/moe/experts/down"] == "AllowA8"
    with ArtifactReader.open(qa16) as reader:
        assert "AllowA8" not in summarize(reader)["activation_policies"]

    calls = []
    real = a8.linear_a8
    monkeypatch.setattr(a8, "linear_a8", lambda x, w: calls.append(tuple(w.shape)) or real(x, w))
    l_a8 = _logprobs(qa8)
    assert calls, "no A8 product ran"
    n_a8 = len(calls)
    l_a16 = _logprobs(qa16)
    assert len(calls) == n_a8, "an A16 artifact ran the A8 product"
    lp = _logprobs(plain)
    # Stated tolerance: mean |delta log-prob| per token against the fp32 unquantized run below 1 nat (the bound
    # the A16 quantized engine test uses: these tiny random GDN models amplify any rounding), and A8 adds at
    # most half again the fp8 A16 run's own distance (measured: dense 0.24 vs 0.23 nats, MoE 0.65 vs 0.50).
    d_a8, d_a16 = float((l_a8 - lp).abs().mean()), float((l_a16 - lp).abs().mean())
    assert d_a8 < 1.0 and d_a8 <= 1.5 * d_a16 + 0.1, (d_a8, d_a16)
    assert not torch.equal(l_a8, l_a16)  # the activations were quantized
    with Engine.start(qa8, device="cpu", dtype="float32") as eng:
        out = eng.generate("hello", max_tokens=4, temperature=0)
    assert len(out.token_ids) >= 1


def test_a8_needs_every_use_to_allow_it():
    from types import SimpleNamespace

    from ninfer.artifact.materializer import a8_parameters

    def use(p, pol):
        return SimpleNamespace(parameter=p, activation_policy=pol)

    reader = SimpleNamespace(directory=SimpleNamespace(uses=(
        use("a", "AllowA8"), use("b", "AllowA8"), use("b", "A16Only"), use("c", "AllowA4"), use("d", None))))
    assert a8_parameters(reader) == {"a"}
