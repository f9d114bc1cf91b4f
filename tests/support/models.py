"""The Qwen3.5 checkpoints tests run on: tiny random Qwen3.5 models built with transformers, with the byte-level
tokenizer the Qwen frontend reads (ChatML specials and Qwen's think/tool-call tags) and well-conditioned random
weights. The generic helpers they use are ``ninfer.testing``'s.

Plain functions, so that session fixtures (tests/conftest.py) and per-package builders share one copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from ninfer.testing import CHATML_SPECIALS
from ninfer.testing import randomize_weights as randomize_any
from ninfer.testing import write_byte_tokenizer as write_any_byte_tokenizer

# transformers prefers flash-linear-attention / causal-conv1d for Qwen3.5 when importable; neither runs on
# CPU tensors, and the tests' oracle is transformers' own torch path.
sys.modules.setdefault("fla", None)
sys.modules.setdefault("causal_conv1d", None)

BYTE_VOCAB_SPECIALS = CHATML_SPECIALS
BYTE_VOCAB_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def write_byte_tokenizer(folder: Path) -> None:
    """One token per byte (ids 0..255), then the ChatML specials (256..258: <|endoftext|>, <|im_start|>,
    <|im_end|>, the EOS) and the think/tool-call tags (259..262)."""
    write_any_byte_tokenizer(folder, specials=BYTE_VOCAB_SPECIALS, added=BYTE_VOCAB_ADDED, eos="<|im_end|>")


# Qwen3.5's GDN parameters: larger decay rates make the tiny models ill-conditioned (HF fp32 itself then drifts
# 1e-2 from fp64); the plain GDN output norm scales around 1.
_QWEN_DRAWS = {
    "A_log": lambda shape, g: torch.log(torch.empty(shape).uniform_(0.1, 2.0, generator=g)),
    "dt_bias": lambda shape, g: torch.empty(shape).uniform_(-1.0, 1.0, generator=g),
    "linear_attn.norm.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
}


def randomize_weights(model, seed: int) -> None:
    """Weights with O(1) logits: matrices N(0, 1/fan_in), zero-centred norms U(-0.5, 0.5), the plain GDN
    output norm U(0.5, 1.5), A_log = log U(0.1, 2), dt_bias U(-1, 1) (``ninfer.testing.randomize_weights``)."""
    randomize_any(model, seed, draws=_QWEN_DRAWS)


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


def tiny_served_model(root: Path, kind: str, text: dict, seed: int) -> tuple[Path, torch.nn.Module]:
    """A :func:`tiny_text_model` of ``kind`` ("dense" or "moe") with the byte tokenizer and EOS <|im_end|>, saved
    in fp32 and converted to ``root/<kind>.ninfer``: (the artifact, the transformers model)."""
    from ninfer.conversion import convert

    model = tiny_text_model(kind, dict(text, eos_token_id=258), seed)
    model.config.architectures = ["Qwen3_5ForCausalLM" if kind == "dense" else "Qwen3_5MoeForCausalLM"]
    folder = root / f"hf_{kind}"
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))
    convert(folder, root / f"{kind}.ninfer", progress=False)
    return root / f"{kind}.ninfer", model


def tiny_qwen_artifact(root: Path, config: dict, *, seed: int, std: float, dtype_name: str = "float32") -> Path:
    """A random Qwen3_5ForCausalLM from ``config`` (matrices drawn N(0, std): the default 0.02 init gives
    near-uniform logits), with the byte tokenizer and EOS <|im_end|>, saved in ``dtype_name`` and converted
    with ninfer.conversion to ``root/tiny.ninfer``."""
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


def add_mtp_tensors(folder: Path, mtp: torch.nn.Module) -> None:
    """Store ``mtp``'s state dict (an MTP module whose attribute names are the checkpoint's, e.g. the training
    script's ``Qwen3_5MTP``) as the saved checkpoint's ``mtp.*`` tensors, and declare one MTP layer with shared
    embeddings in its config (in ``text_config`` when the config nests one)."""
    from safetensors.torch import load_file, save_file

    st = folder / "model.safetensors"
    tensors = load_file(st)
    tensors.update({f"mtp.{k}": v.detach().clone().contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, st, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
