"""Fixtures of the context-cache tests: a tiny random Qwen3.5 artifact with a long position range
(8k-token multi-turn prompts), engines over it with fp32 reference ops on the CPU, closed at teardown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

IM_START, IM_END, ENDOFTEXT = 257, 258, 256
THINK, END_THINK = 259, 260

TINY_LONG = dict(
    vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=1, linear_num_value_heads=2, max_position_embeddings=16384,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    tie_word_embeddings=False)


@pytest.fixture(autouse=True, scope="package")
def single_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _write_tokenizer(folder: Path) -> None:
    """Byte tokens 0..255, then <|endoftext|> 256, <|im_start|> 257, <|im_end|> 258, <think> 259, </think> 260."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
    assert tok.token_to_id("<|im_end|>") == IM_END and tok.token_to_id("</think>") == END_THINK
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                              "pad_token": "<|endoftext|>"}))


@pytest.fixture(scope="session")
def long_tiny_artifact(tmp_path_factory) -> Path:
    """A random 4-layer Qwen3.5 (3 GDN + 1 attention) with 16k positions, float32, converted."""
    sys.modules.setdefault("fla", None)
    sys.modules.setdefault("causal_conv1d", None)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ninfer_convert.convert import convert

    root = tmp_path_factory.mktemp("cc_tiny")
    folder = root / "hf"
    folder.mkdir()
    cfg = transformers.Qwen3_5TextConfig(**TINY_LONG, eos_token_id=IM_END)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(4321)
    model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    artifact = root / "tiny.ninfer"
    convert(folder, artifact, progress=False)
    return artifact


@pytest.fixture
def make_engine(long_tiny_artifact):
    """``make_engine(**options) -> Engine`` on the long tiny artifact (cpu, float32); closed at teardown."""
    from ninfer import Engine, EngineOptions

    made = []

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("dtype", "float32")
        options.setdefault("page_size", 16)
        engine = Engine.start(long_tiny_artifact, EngineOptions(**options))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close(timeout=60)


def settled(engine):
    """The stats once the worker has published the cycle that settled every request (a result is
    delivered before that cycle's snapshot)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        s = engine.stats()
        if (s.running == 0 and s.queue_depth == 0 and s.outstanding == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.005)
