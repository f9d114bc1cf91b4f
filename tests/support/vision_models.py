"""A tiny random Qwen3.5 ``ForConditionalGeneration`` artifact an Engine can start: the tower and text geometry of
tests/models/qwen3_5/vision_harness.py, a byte tokenizer whose specials include Qwen's vision tokens (their ids are
the model config's placeholder ids), and image and video preprocessing settings scaled to the tiny tower (patch 4,
merge 2: a 32 x 48 image is 8 x 12 patches, 24 placeholder tokens).

Plain functions; the engine tests' fixtures build it once per session.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.modules.setdefault("fla", None)
sys.modules.setdefault("causal_conv1d", None)

from ninfer.testing import CHATML_SPECIALS, randomize_weights, write_byte_tokenizer  # noqa: E402

VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIALS = (*CHATML_SPECIALS, *VISION_SPECIALS)         # ids 256.. in this order
IM_END = 258
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 259, 260, 261, 262
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")   # 263..266

TEXT = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, num_hidden_layers=4, max_position_embeddings=4096, intermediate_size=96,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True))
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=25, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
TOKENS = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
              vision_end_token_id=VISION_END)
# The tiny tower's preprocessing: Qwen3.5's rules at patch 4 (factor 8). Images from 16 x 16 to 48 x 48 pixels
# (at most 36 tokens); videos up to 4,096 pixels over all sampled frames, 2 frames a second, 4 to 8 frames.
IMAGE_CONFIG = {"size": {"longest_edge": 48 * 48, "shortest_edge": 16 * 16}, "patch_size": 4,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5]}
VIDEO_CONFIG = {"size": {"longest_edge": 4096, "shortest_edge": 256}, "patch_size": 4, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2,
                "min_frames": 4, "max_frames": 8}

_DRAWS = {
    "A_log": lambda shape, g: torch.log(torch.empty(shape).uniform_(0.1, 2.0, generator=g)),
    "dt_bias": lambda shape, g: torch.empty(shape).uniform_(-1.0, 1.0, generator=g),
    "linear_attn.norm.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    "norm1.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    "norm2.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    "merger.norm.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    "patch_embed.proj.weight": lambda shape, g: torch.randn(shape, generator=g) / 96 ** 0.5,
}


# A Qwen4-Exp text model of the same width for the same tower: 4 layers (3 GDN + QSA keeping 2 blocks of 2 tokens),
# 3 streams, PLE on GDN layer 2, MRoPE sections (3, 3, 2) over 16 rotary dims.
QWEN4EXP_TEXT = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=4,
                     max_position_embeddings=4096, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                     num_experts=8, num_experts_per_tok=2, hc_count=3, hc_lowrank=8, ple_layer_ids=[2],
                     ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
                     make_ngram_vocab_size_divisible_by=8, split_ngram_parts=3, indexer_n_heads=2,
                     indexer_head_dim=16, indexer_kv_heads=1, indexer_budget=4, indexer_compress_ratio=2,
                     output_gate_type="sigmoid", eos_token_id=IM_END, tie_word_embeddings=False,
                     rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5,
                                          mrope_section=[3, 3, 2], mrope_interleaved=True))


def tiny_vision_model(seed: int = 31, arch: str = "qwen3_5"):
    """The transformers model (fp32, eval), random weights with O(1) logits: Qwen3.5's, or with ``arch``
    "qwen4exp" Qwen4-Exp's text model behind the same tower."""
    import transformers as tf

    if arch == "qwen4exp":
        model = tf.Qwen4ExpForConditionalGeneration(tf.Qwen4ExpConfig(
            text_config=QWEN4EXP_TEXT, vision_config=VISION, **TOKENS))
    else:
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKENS))
    randomize_weights(model, seed, draws=_DRAWS)
    if arch == "qwen4exp":
        with torch.no_grad():   # the stream reduction's output is ~0.5 in size: a wider head gives O(1) logits
            model.lm_head.weight.mul_(3.0)
    return model.float().eval()


def tiny_vision_artifact(root: Path, seed: int = 31, arch: str = "qwen3_5") -> tuple[Path, object]:
    """``(artifact, hf_model)``: the model saved with the tokenizer, generation config (EOS <|im_end|>) and the
    preprocessing settings, converted to ``root/vision.ninfer`` (``arch``: as :func:`tiny_vision_model`)."""
    from ninfer.conversion import convert

    model = tiny_vision_model(seed, arch)
    folder = root / "vision_hf"
    model.save_pretrained(folder)
    write_byte_tokenizer(folder, specials=SPECIALS, added=ADDED, eos="<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    artifact = root / "vision.ninfer"
    convert(folder, artifact, progress=False)
    return artifact, model


def hf_inputs(prompt) -> dict:
    """transformers' inputs for one of our PreparedPrompts (the same token ids and pixel rows)."""
    ids = list(prompt.token_ids)
    types = [0] * len(ids)
    images, image_grids, videos, video_grids = [], [], [], []
    for m in prompt.media:
        for a, b in m.spans:
            types[a:b] = [1 if m.kind == "image" else 2] * (b - a)
        (images if m.kind == "image" else videos).append(m.pixels)
        (image_grids if m.kind == "image" else video_grids).append(list(m.grid))
    out = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([types])}
    if images:
        out.update(pixel_values=torch.cat(images), image_grid_thw=torch.tensor(image_grids))
    if videos:
        out.update(pixel_values_videos=torch.cat(videos), video_grid_thw=torch.tensor(video_grids))
    return out


def hf_greedy(model, prompt, steps: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (a PreparedPrompt), ``steps`` tokens, no early stop."""
    model.model.rope_deltas = None
    inputs = hf_inputs(prompt)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, n:].tolist()
