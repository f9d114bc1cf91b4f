"""The models tests run on: the embedded default model converted into a private cache, and tiny random
Qwen3.5 checkpoints built with transformers (byte-level tokenizer, well-conditioned random weights).

Plain functions, so that session fixtures (tests/conftest.py) and per-package builders share one copy.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

# transformers prefers flash-linear-attention / causal-conv1d for Qwen3.5 when importable; neither runs on
# CPU tensors, and the tests' oracle is transformers' own torch path.
sys.modules.setdefault("fla", None)
sys.modules.setdefault("causal_conv1d", None)

BYTE_VOCAB_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def default_model_in(cache: Path) -> Path:
    """Converts the embedded default model into ``cache`` (as NINFER_CACHE_DIR) and returns its artifact.

    NINFER_CACHE_DIR is set only for the conversion and restored after, so the user's cache is never
    touched and no other test sees the variable change.
    """
    from ninfer.model_source import resolve_model

    old = os.environ.get("NINFER_CACHE_DIR")
    os.environ["NINFER_CACHE_DIR"] = str(cache)
    try:
        return resolve_model(None)
    finally:
        if old is None:
            os.environ.pop("NINFER_CACHE_DIR")
        else:
            os.environ["NINFER_CACHE_DIR"] = old


def write_byte_tokenizer(folder: Path) -> None:
    """Byte-level BPE with no merges: one token per byte (ids 0..255), then the Qwen specials (256..258:
    <|endoftext|>, <|im_start|>, <|im_end|>, the EOS) and the think/tool-call tags (259..262)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in BYTE_VOCAB_SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in BYTE_VOCAB_ADDED])
    assert tok.token_to_id("<|im_end|>") == 258
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                              "pad_token": "<|endoftext|>"}))


def randomize_weights(model, seed: int) -> None:
    """Weights with O(1) logits: matrices N(0, 1/fan_in), zero-centred norms U(-0.5, 0.5), the plain GDN
    output norm U(0.5, 1.5), A_log = log U(0.1, 2), dt_bias U(-1, 1). Zero/one initialisations would hide
    bugs; larger decay rates make the tiny models ill-conditioned (HF fp32 itself then drifts 1e-2 from
    fp64)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.1, 2.0, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif p.ndim == 1:
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def tiny_text_model(kind: str, text: dict, seed: int, **config):
    """A random fp32 Qwen3.5 text model from transformers, eval mode: ``kind`` "dense" or "moe", ``text`` the
    text-config kwargs (plus ``config``), weights from :func:`randomize_weights`."""
    import transformers as tf

    if kind == "dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text, **config))
    elif kind == "moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text, **config))
    else:
        raise ValueError(f"unknown tiny text model kind {kind!r}")
    randomize_weights(model, seed)
    return model.float().eval()



def tiny_qwen_artifact(root: Path, config: dict, *, seed: int, std: float, dtype_name: str = "float32") -> Path:
    """A random Qwen3_5ForCausalLM from ``config`` (matrices drawn N(0, std): the default 0.02 init gives
    near-uniform logits), with the byte tokenizer and EOS <|im_end|>, saved in ``dtype_name`` and converted
    with ninfer.conversion to ``root/tiny.ninfer``."""
    import torch
    import transformers
    from ninfer.conversion import convert

    folder = root / "hf"
    folder.mkdir()
    cfg = transformers.Qwen3_5TextConfig(**config, eos_token_id=258)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.to(getattr(torch, dtype_name)).save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))
    artifact = root / "tiny.ninfer"
    convert(folder, artifact, progress=False)
    return artifact
