"""The plugin guide's example is a working plugin, and the guide quotes it as it is.

``examples/ninfer-llama-mini`` is built and pip-installed into a temporary site; a subprocess with that site
on PYTHONPATH (``run_example_plugin.py``) lists it, converts two tiny random ``LlamaForCausalLM`` checkpoints
(untied and tied embeddings) with it, checks its ModelProfile against its Program's allocations
(``ninfer.testing``), computes the Program's logits in chunks over a paged KV pool, and generates greedily
through the Engine (three prompts decoding together, prefill in chunks over four-token pages). transformers,
in this process, is the oracle: fp32 logits within 1e-4, greedy tokens equal. The guide's code blocks marked
``<!-- example: PATH -->`` (PATH from the repository root) must equal those files, those marked
``<!-- excerpt: PATH -->`` must be verbatim parts of them, and the guide names every file of the example.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ninfer.testing import (
    first_divergence,
    randomize_weights,
    reference_greedy,
    reference_logits,
    save_checkpoint,
    torch_threads,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ninfer-llama-mini"
GUIDE = ROOT / "docs" / "plugins.md"
RUNNER = Path(__file__).with_name("run_example_plugin.py")

GEOMETRY = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                bos_token_id=256, eos_token_id=258)
PROMPTS = [list(b"def fibonacci(n):"), list(b"hello"), list(b"The quick brown fox jumps over")]
MAX_TOKENS = 12
CHUNK = 6   # prefill chunk: the longest prompt takes several, each attending over the pages before it
LOGITS_ATOL = 1e-4


@dataclass(frozen=True)
class Session:
    results: dict
    logits: dict[str, torch.Tensor]
    models: dict[str, torch.nn.Module]


def _tiny_llama(tied: bool, seed: int) -> torch.nn.Module:
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**GEOMETRY, tie_word_embeddings=tied))
    # Plain-weight RMSNorms: scales around 1, not around 0.
    randomize_weights(model, seed, vectors=(0.5, 1.5))
    return model.float().eval()


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Session:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("example-plugin")
    project = root / "project"   # built from a copy: a build leaves build/ and *.egg-info beside the sources
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(project)], check=True, capture_output=True)
    models = {"untied": _tiny_llama(False, seed=5), "tied": _tiny_llama(True, seed=6)}
    checkpoints = {name: str(save_checkpoint(m, root / name)) for name, m in models.items()}
    out = root / "out"
    out.mkdir()
    spec = root / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "checkpoints": checkpoints, "engine_checkpoint": "untied",
                                "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "chunk": CHUNK}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(RUNNER), str(spec)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    logits = {name: torch.load(out / f"logits-{name}.pt") for name in models}
    return Session(json.loads((out / "results.json").read_text()), logits, models)


def test_the_installed_example_registers_its_hooks(session):
    plugin = session.results["plugin"]
    assert plugin is not None, "the installed example's entry point 'llama_mini' was not loaded"
    assert (plugin["distribution"], plugin["version"]) == ("ninfer-llama-mini", "0.1.0")
    assert plugin["registered"] == {"architectures": ["LlamaMiniForCausalLM"], "op_contracts": ["llama_rms_norm"],
                                    "ops": ["llama_rms_norm:torch_reference"], "source_mappings": ["llama_mini"],
                                    "source_architectures": ["LlamaForCausalLM"]}
    engine = session.results["engine"]
    assert engine["architecture"] == "LlamaMiniForCausalLM"
    assert engine["ops"]["llama_rms_norm"] == "torch_reference"


def test_the_profile_matches_the_program_allocations(session):
    assert session.results["profile"] == {f"{name}/{dtype}": [] for name in ("untied", "tied")
                                          for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_program_logits_equal_transformers(session, name):
    with torch_threads(1):
        expected = reference_logits(session.models[name], PROMPTS[0])
    torch.testing.assert_close(session.logits[name], expected, atol=LOGITS_ATOL, rtol=0)


def test_engine_greedy_tokens_equal_transformers(session):
    with torch_threads(1):
        expected = [reference_greedy(session.models["untied"], p, MAX_TOKENS) for p in PROMPTS]
    ours = session.results["engine"]["greedy"]
    for prompt, a, b in zip(PROMPTS, ours, expected, strict=True):
        assert a == b, f"prompt {bytes(prompt)!r}: first difference at token {first_divergence(a, b)}: {a} vs {b}"


# -- the guide quotes the example ------------------------------------------------------------------------------
_QUOTE = re.compile(r"<!-- (example|excerpt): (\S+) -->\n```[a-z]*\n(.*?)```\n", re.DOTALL)


def _quotes() -> list[tuple[str, str, str]]:
    return _QUOTE.findall(GUIDE.read_text(encoding="utf-8"))


def test_the_guide_quotes_the_example_files_verbatim():
    quotes = _quotes()
    example = "examples/ninfer-llama-mini/"
    assert {path for kind, path, _ in quotes if kind == "example"} >= {
        example + "pyproject.toml", example + "src/ninfer_llama_mini/plugin.py",
        example + "src/ninfer_llama_mini/program.py", example + "src/ninfer_llama_mini/layout.py"}
    for kind, path, block in quotes:
        text = (ROOT / path).read_text(encoding="utf-8")
        if kind == "example":
            assert block == text, f"docs/plugins.md quotes {path} as it no longer is: copy the file into the guide"
        else:
            assert block in text, f"docs/plugins.md quotes a part of {path} that the file no longer has"


def test_the_guide_names_every_file_of_the_example():
    guide = GUIDE.read_text(encoding="utf-8")
    files = sorted(str(p.relative_to(EXAMPLE)) for p in EXAMPLE.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p))
    assert [f for f in files if f"`{f}`" not in guide] == []
