"""Tiny random Qwen3.5 / Qwen3.5-MoE ``*ForConditionalGeneration`` checkpoints with a vision tower, built with
transformers, converted with our converter and loaded with the ``vision`` feature (CPU, fp32).

The text geometry exercises all three MRoPE axes: rotary dim 16 (8 frequencies) with interleaved sections
(3, 3, 2), so T, H and W each own frequencies. The placeholder ids live inside the tiny vocabulary. The tower
has depth 2, hidden 32 (2 heads of 16), patch 4 (96 values per row), a 5 x 5 learned position grid.

``media_inputs`` builds what a prompt carries: the token ids with each medium's placeholder runs
(``<|vision_start|> <|image_pad|>*n <|vision_end|>``; a video one run per temporal patch, each after a timestamp
token, as Qwen3.5's processor writes them), the pixel rows, and the HF-side tensors the oracle needs.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)            # force transformers' torch GDN path (the oracle)
sys.modules.setdefault("causal_conv1d", None)

import hashlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from ninfer.artifact import ArtifactReader, load_weights  # noqa: E402
from ninfer.contracts.architecture import ProgramInit, ProgramOptions  # noqa: E402
from ninfer.contracts.features import StartupFeatures  # noqa: E402
from ninfer.contracts.media import MediaInput  # noqa: E402
from ninfer.ops import resolve_ops  # noqa: E402
from ninfer.plugins import get_registry  # noqa: E402

IMAGE, VIDEO, START, END, TIMESTAMP = 500, 501, 502, 503, 504
TEXT = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, num_hidden_layers=4, max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True))
DENSE_TEXT = dict(TEXT, intermediate_size=96)
MOE_TEXT = dict(TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=25, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
ROW = 3 * 2 * 4 * 4

_DRAWS = {
    "A_log": lambda shape, g: torch.log(torch.empty(shape).uniform_(0.1, 2.0, generator=g)),
    "dt_bias": lambda shape, g: torch.empty(shape).uniform_(-1.0, 1.0, generator=g),
    "linear_attn.norm.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    # LayerNorm scales around 1; the patch embedding N(0, 1/row) (its fan-in is the whole row).
    "norm1.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    "norm2.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    "merger.norm.weight": lambda shape, g: torch.empty(shape).uniform_(0.5, 1.5, generator=g),
    "patch_embed.proj.weight": lambda shape, g: torch.randn(shape, generator=g) / ROW ** 0.5,
}


@dataclass
class VisionCase:
    kind: str
    hf: torch.nn.Module
    artifact: Path
    config: dict
    weights: dict
    spec: object


def build_case(kind: str, root: Path, seed: int) -> VisionCase:
    """``kind`` "dense" or "moe": build, save, convert and load (text + vision weights)."""
    import transformers as tf
    from ninfer.conversion import convert
    from ninfer.testing.checkpoints import randomize_weights as randomize_any

    if kind == "dense":
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=DENSE_TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKENS))
    else:
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=MOE_TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKENS))
    randomize_any(model, seed, draws=_DRAWS)
    model = model.float().eval()
    src = root / f"{kind}_hf"
    model.save_pretrained(src)
    out = root / f"{kind}.ninfer"
    convert(src, out, progress=False)
    reader = ArtifactReader.open(out)
    config = reader.component("text").config
    spec = get_registry().architecture(config["architectures"][0])
    weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures(vision=True)), "cpu")
    return VisionCase(kind, model, out, config, weights, spec)


def make_vision_program(case: VisionCase, *, vision: bool = True, page_size: int = 4, num_pages: int = 512,
                        max_sequences: int = 4, max_context: int = 2048, lookahead_slots: int = 0,
                        checkpoint_slots: int = 0):
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=max_sequences,
                             page_size=page_size, num_pages=num_pages, max_context=max_context,
                             lookahead_slots=lookahead_slots, checkpoint_slots=checkpoint_slots)
    weights = case.weights if vision else {k: v for k, v in case.weights.items() if not k.startswith("vision/")}
    return case.spec.create_program(ProgramInit(config=case.config, weights=weights, ops=ops, options=options,
                                                features=StartupFeatures(vision=vision)))


def pixels(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, ROW, generator=torch.Generator().manual_seed(seed))


@dataclass
class Prompt:
    """A prompt as our Program takes it (``tokens``, ``media``) and as transformers does (the rest)."""

    tokens: list[int]
    media: tuple[MediaInput, ...]
    hf_inputs: dict


def media_prompt(parts: list, seed: int = 0) -> Prompt:
    """``parts``: ints (text token ids), ``("image", (1, h, w))`` or ``("video", (t, h, w))``, in order."""
    tokens: list[int] = []
    media: list[MediaInput] = []
    types: list[int] = []
    images, image_grids, videos, video_grids = [], [], [], []
    for i, part in enumerate(parts):
        if isinstance(part, int):
            tokens.append(part)
            types.append(0)
            continue
        kind, grid = part
        t, h, w = grid
        rows = pixels(grid, seed * 100 + i)
        per_frame = h * w // 4
        frames = 1 if kind == "image" else t
        run = per_frame * (t if kind == "image" else 1)
        pad = IMAGE if kind == "image" else VIDEO
        spans = []
        for _ in range(frames):
            if kind == "video":
                tokens.append(TIMESTAMP)
                types.append(0)
            tokens.append(START)
            types.append(0)
            spans.append((len(tokens), len(tokens) + run))
            tokens.extend([pad] * run)
            types.extend([1 if kind == "image" else 2] * run)
            tokens.append(END)
            types.append(0)
        digest = hashlib.sha256(rows.numpy().tobytes() + repr(grid).encode()).hexdigest()
        media.append(MediaInput(kind=kind, pixels=rows, grid=grid, digest=digest, token_id=pad, spans=tuple(spans)))
        (images if kind == "image" else videos).append(rows)
        (image_grids if kind == "image" else video_grids).append(grid)
    hf_inputs = {"input_ids": torch.tensor([tokens]), "mm_token_type_ids": torch.tensor([types])}
    if images:
        hf_inputs.update(pixel_values=torch.cat(images), image_grid_thw=torch.tensor(image_grids))
    if videos:
        hf_inputs.update(pixel_values_videos=torch.cat(videos), video_grid_thw=torch.tensor(video_grids))
    return Prompt(tokens, tuple(media), hf_inputs)
