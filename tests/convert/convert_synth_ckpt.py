"""Synthetic Hugging Face checkpoint folders for the converter tests (written with safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from convert_synth_arch import ARCH
from safetensors.torch import save_file

# bf16 bit patterns a value-preserving import must keep exactly: quiet NaNs with payloads and
# both signs, a signalling NaN, signed zeros, infinities, the smallest subnormal.
SPECIAL_BF16_BITS = (0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001)


def _to_bits(values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values], dtype=torch.int16)


def synth_tensors(*, layers: int = 2, hidden: int = 16, vocab: int = 32, inter: int = 24, kv: int = 8,
                  seed: int = 0, vision: bool = False, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of a ``SynthForCausalLM`` checkpoint: bf16 weights (the embedding carries the
    special bit patterns), an fp16 head, fp32 final norm, optional vision (incl. int32) and mtp."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    embed = rnd(vocab, hidden)
    special = _to_bits(SPECIAL_BF16_BITS)
    embed.view(torch.int16).view(-1)[: special.numel()] = special
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": rnd(hidden, dtype=torch.float32),
        "lm_head.weight": rnd(vocab, hidden, dtype=torch.float16),
        "model.rotary_emb.inv_freq": rnd(hidden // 2, dtype=torch.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(hidden, hidden)
        t[p + "self_attn.k_proj.weight"] = rnd(kv, hidden)
        t[p + "self_attn.v_proj.weight"] = rnd(kv, hidden)
        t[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        t[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        t[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
        t[p + "input_layernorm.weight"] = rnd(hidden)
    if vision:
        t["visual.patch_embed.weight"] = rnd(hidden, 12)
        t["visual.position_ids"] = torch.arange(6, dtype=torch.int32)
    if mtp:
        t["mtp.fc.weight"] = rnd(hidden, 2 * hidden, dtype=torch.float32)
    return t


def write_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1,
                     config: dict | None = None, files: dict[str, str | bytes] | None = None,
                     architecture: str = ARCH) -> Path:
    """Write ``folder`` as a HF checkpoint: config.json, one ``model.safetensors`` (``shards=1``) or
    ``shards`` files with ``model.safetensors.index.json``, plus extra ``files`` (name -> content)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [architecture], "hidden_size": 16, **(config or {})}
    (folder / "config.json").write_text(json.dumps(cfg))
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        weight_map: dict[str, str] = {}
        per = -(-len(names) // shards)
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            group = names[s * per:(s + 1) * per]
            save_file({n: tensors[n] for n in group}, str(folder / fname))
            weight_map.update(dict.fromkeys(group, fname))
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    for name, content in (files or {}).items():
        path = folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return folder


def tiny_tokenizer_json() -> str:
    """A valid ``tokenizer.json`` (word-level, ids 0..3: ``<unk> a b <e>``; ``<e>`` is a special token) that
    the converter's resource check accepts: ``Tokenizer.from_str`` loads it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<e>", special=True, normalized=False)])
    return tok.to_str()


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's little-endian bytes, exactly as safetensors stores them."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()
