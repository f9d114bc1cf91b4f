"""Tiny checkpoints for tests: a byte-level tokenizer, well-conditioned random weights, a saved Hugging Face
folder converted to a ``.ninfer`` artifact, and the embedded default model in a private cache.

Nothing here imports transformers: a helper that needs a model takes one the caller built (the test's
oracle), so this module imports with ninfer-core alone.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

#: ChatML control tokens, the byte tokenizer's default specials (ids 256, 257, 258; the last is the EOS).
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Draws one parameter's values: ``draw(shape, generator) -> tensor``.
Draw = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


def write_byte_tokenizer(folder: Path, *, specials: Sequence[str] = CHATML_SPECIALS, added: Sequence[str] = (),
                         eos: str | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of a byte-level BPE with no merges into ``folder``:
    one token per byte (ids 0..255, so any text round-trips), then ``specials`` (special tokens) and ``added``
    (plain added tokens) in order. ``eos`` (default: the last special) is the tokenizer config's EOS token and
    the first special its pad token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in added])
    tok.save(str(Path(folder) / "tokenizer.json"))
    config = {"eos_token": eos or specials[-1], "pad_token": specials[0]} if specials else {}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))


def randomize_weights(model: torch.nn.Module, seed: int, *, vectors: tuple[float, float] = (-0.5, 0.5),
                      draws: Mapping[str, Draw] | None = None) -> None:
    """Give ``model`` weights with O(1) logits, in place: a parameter whose name ends with a key of ``draws``
    takes that draw; other matrices N(0, 1/fan_in); other vectors U(*vectors). The default init (N(0, 0.02),
    unit norms) gives near-uniform logits, where a wrong op hides in the noise and greedy ties are common."""
    g = torch.Generator().manual_seed(seed)
    draws = draws or {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            draw = next((d for suffix, d in draws.items() if name.endswith(suffix)), None)
            if draw is not None:
                p.copy_(draw(shape, g))
            elif p.ndim == 1:
                p.copy_(torch.empty(shape).uniform_(*vectors, generator=g))
            else:
                p.copy_(torch.randn(shape, generator=g) / math.sqrt(shape[-1]))


def save_checkpoint(model: torch.nn.Module, folder: Path, *, tokenizer: Mapping[str, object] | None = None,
                    generation_config: Mapping[str, object] | None = None) -> Path:
    """Save ``model`` (a transformers model) with ``save_pretrained`` into ``folder`` with a byte tokenizer
    (``tokenizer``: keyword arguments of :func:`write_byte_tokenizer`) and, when given, ``generation_config``
    (written over the one transformers saves). Returns ``folder``."""
    folder = Path(folder)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder, **dict(tokenizer or {}))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(dict(generation_config)))
    return folder


def convert_checkpoint(folder: Path, artifact: Path) -> Path:
    """Convert the Hugging Face ``folder`` to ``artifact`` with :func:`ninfer.conversion.convert` (the
    registered source mapping of its ``architectures[0]``); returns ``artifact``."""
    from ninfer.conversion import convert

    convert(Path(folder), Path(artifact), progress=False)
    return Path(artifact)


def default_model_in(cache: Path) -> Path:
    """Convert the default model (the first registered ``ninfer_default_models``) into ``cache`` (as
    ``NINFER_CACHE_DIR``) and return its artifact; later calls only look it up.

    The variable is set only for the call and restored after, so the user's cache is never touched and no
    other test sees it change."""
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
