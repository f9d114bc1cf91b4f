#!/usr/bin/env python3
"""Vision speed at the published Qwen3.5 shapes (random weights), against transformers in the same run (issue 33
item 7): the tower's encode time per input, in ms and as a fraction of the bf16 matmul peak measured in the same
run, and the TTFT of a chat turn with one 1024x1024 image on the 9B text shape.

Model: a random transformers ``Qwen3_5ForConditionalGeneration`` built in the run dtype directly on the device
(bf16 on CUDA), the 9B text shape of tools/gpu_bench_shapes.py (hidden 4096, 32 layers, vocabulary 248,320,
untied) and Qwen3.5's tower: depth 27, hidden 1152, MLP 4304, 16 heads (head width 72), patch 16, temporal patch
2, spatial merge 2, a learned 48 x 48 position grid (2,304 entries), gelu_pytorch_tanh, axial rope theta 1e4, no
deepstack, output width = the text hidden size (4096). Sources: transformers' ``Qwen3_5VisionConfig`` defaults
(the values above) and the Qwen3-VL checkpoints' published ``vision_config`` (the same tower; Qwen3.5 drops
deepstack). ~9.41 B parameters (0.456 B of them the tower), ~18.8 GB bf16. Init as tools/gpu_bench_shapes.py (matrices N(0, 1/fan_in), other
vectors U(-0.5, 0.5), GDN gates as there) plus the tower's LayerNorm weights U(0.5, 1.5). It is converted in
memory by our converter (gpu_bench_shapes.convert_in_memory) with a byte-level tokenizer whose specials include
the vision tokens (the prompt's text is ~60 byte tokens; the image is 1,024 placeholder tokens).

Inputs (pixel rows by our frontend's preprocessing, the Qwen3.5 defaults; the same rows go to both):

| input | patch grid (t, h, w) | patches | tokens | tower TFLOP (of it attention) |
|---|---|---|---|---|
| image 448x448 | (1, 28, 28) | 784 | 196 | 0.74 (0.08) |
| image 1024x1024 | (1, 64, 64) | 4,096 | 1,024 | 5.55 (2.09) |
| image 1920x1080 (resized to 1920x1088) | (1, 68, 120) | 8,160 | 2,040 | 15.19 (8.28) |
| video 10 s, 1280x720 at 30 fps, sampled at 2 fps: 20 frames (resized to 1280x704) | (10, 44, 80) | 35,200 | 8,800 | 45.19 (15.42) |

The video's 20 sampled frames are synthesised and go through our ``process_video`` (no PyAV needed).

Measured:

1. the bf16 ``torch.matmul`` peak (n = 8192; ``ninfer.bench.limits.measure_matmul_peak``);
2. encode, per input: our tower (``VisionTower.encode`` of the started engine's Program, with the ops the engine
   resolved) and transformers' ``get_image_features`` / ``get_video_features``, on the same device-resident
   pixel rows in the run dtype, one call per input (the whole video as one grid), warm, CUDA-event timed, median
   of ``--repeats``. FLOPs (stated per row): the tower's linear layers (patch embedding, qkv, proj, fc1, fc2 per
   block, the merger's two) at 2 per multiply-add, plus attention 4 * hidden * sum(L^2) per block over the
   frames' segments (QK^T and PV). Fraction of peak = FLOPs / time / matmul peak. Each row also gives the max abs
   difference of the two sides' merged embeddings (the same work: fp32 agrees to ~1e-6, bf16 to its rounding);
3. TTFT of a chat turn (one 1024x1024 image + a sentence, no thinking): ours through ``ninfer.Engine``
   (``prepare_chat`` once, timed apart; then ``submit`` -> first token, context cache off so each turn encodes
   the image again, warm, median); transformers' ``generate(max_new_tokens=1)`` on the same token ids and pixel
   rows (placed on the device beforehand), median.

Expected on one H200 (~150 s; ``--budget-s`` 240 stops starting new measurements when spent, and a watchdog
dumps the stacks and exits 60 s after it): build ~15 s, in-memory conversion ~20 s (a ~18.8 GB artifact in a temp
folder, removed at the end), engine start ~30 s, inputs ~5 s, encode ~15 s, TTFT ~15 s (+ ~45 s if
flash-linear-attention is importable: its first prefill compiles). Device memory: ~19 GB transformers + ~19 GB
ours + ~4 GB encoder workspace + attention scores.

``--tiny`` keeps the inputs (their sizes and grids) and shrinks the widths (tower depth 2, hidden 32; text hidden
64, 4 layers), fp32: a CPU check of the whole method in ~30 s. ``--text-layers N`` shortens the text model only.

    python3 tools/vision_speed.py --out $OUT                       # the H200 run
    python3 tools/vision_speed.py --tiny --device cpu --out /tmp/v    # tiny widths on the CPU: checks the method
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_shapes  # noqa: E402
from gpu_bench_shapes import (  # noqa: E402
    PHASES,
    SHAPES,
    START,
    TINY,
    Phase,
    convert_in_memory,
    force_torch_path,
    gdn_path,
    kernel_paths,
    log,
    random_model,
)

gpu_bench_shapes.LOG_TAG = "vision"


VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
              hidden_act="gelu_pytorch_tanh")
TINY_VISION = dict(VISION, depth=2, hidden_size=32, intermediate_size=64, num_heads=2)
# A byte-level tokenizer: ids 0..255 bytes, then these specials (their ids are the model's placeholder ids).
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>")
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")
IM_END = 258
TOKENS = dict(vision_start_token_id=259, vision_end_token_id=260, image_token_id=261, video_token_id=262)
QUESTION = "Describe this image in one sentence."

# (name, kind, (height, width)); a video: (name, "video", (height, width, seconds, source fps)).
INPUTS = [("image 448x448", "image", (448, 448)), ("image 1024x1024", "image", (1024, 1024)),
          ("image 1920x1080", "image", (1080, 1920)), ("video 10s 2fps 1280x720", "video", (720, 1280, 10, 30))]
TTFT_IMAGE = (1024, 1024)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (the inputs keep their sizes), fp32: a CPU check")
    ap.add_argument("--text-layers", type=int, default=None, help="text layers (default: the 9B's 32; tiny 4)")
    ap.add_argument("--repeats", type=int, default=None, help="measured runs per case (default 7; tiny 1)")
    ap.add_argument("--ttft-repeats", type=int, default=None, help="measured chat turns (default 5; tiny 1)")
    ap.add_argument("--hf-path", choices=("auto", "torch"), default="auto",
                    help="auto: transformers uses flash-linear-attention / causal_conv1d when importable (never "
                         "off CUDA); torch: its torch fallback")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--work", type=Path, default=None, help="folder for the artifact (default: a temp folder)")
    ap.add_argument("--keep-artifact", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.tiny else 7)
    args.ttft_repeats = args.ttft_repeats or (1 if args.tiny else 5)
    args.text_layers = args.text_layers or (4 if args.tiny else SHAPES["9b"]["num_hidden_layers"])
    if args.hf_path == "auto" and not args.device.startswith("cuda"):
        args.hf_path = "torch"   # flash-linear-attention beside transformers breaks its CPU forward
    return args


def remaining(args) -> float:
    return args.budget_s - (time.perf_counter() - START)


# -- model -----------------------------------------------------------------------------------------
def configs(args) -> tuple[dict, dict]:
    """(text config, vision config) of the HF composite model."""
    text = {k: v for k, v in (TINY if args.tiny else SHAPES)["9b"].items() if k != "kind"}
    layers = args.text_layers
    text.update(num_hidden_layers=layers,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    vision = dict(TINY_VISION if args.tiny else VISION, out_hidden_size=text["hidden_size"])
    return text, vision


def build_hf(text: dict, vision: dict, device, dtype, seed: int):
    """A random transformers Qwen3_5ForConditionalGeneration built in ``dtype`` directly on ``device``."""
    import transformers as tf

    config = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **TOKENS)
    model = random_model(lambda: tf.Qwen3_5ForConditionalGeneration(config), device, dtype, seed,
                         norms=("linear_attn.norm.weight", "norm1.weight", "norm2.weight", "merger.norm.weight"))
    model.config.architectures = [type(model).__name__]
    return model.eval()


def write_frontend(folder: Path) -> None:
    from ninfer.testing import write_byte_tokenizer

    write_byte_tokenizer(folder, specials=SPECIALS, added=ADDED, eos="<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END]}))


# -- inputs ----------------------------------------------------------------------------------------
def synthetic_rgb(height: int, width: int, seed: int, frames: int = 0):
    """uint8 RGB ``[H, W, 3]`` (``[frames, H, W, 3]`` when frames): gradients plus noise, moving with the frame."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for i in range(max(frames, 1)):
        base = np.stack([(x * 255 / max(width - 1, 1) + 9 * i) % 256, (y * 255 / max(height - 1, 1) + 5 * i) % 256,
                         ((x + y) * 127 / max(width + height - 2, 1) + 13 * i) % 256], -1)
        out.append(np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8))
    return np.stack(out) if frames else out[0]


def processed(kind: str, size: tuple, seed: int):
    """(pixel rows float32 [N, C*Tp*P*P], grid (t, h, w)) by our frontend's preprocessing (Qwen3.5 defaults)."""
    from ninfer_qwen3_5.frontend.vision import DecodedVideo, process_image, process_video
    from ninfer_qwen3_5.frontend.vision.config import VideoPreprocessConfig
    from ninfer_qwen3_5.frontend.vision.sampling import sample_frame_indices
    from PIL import Image

    if kind == "image":
        p = process_image(Image.fromarray(synthetic_rgb(size[0], size[1], seed)))
        return p.pixel_values, tuple(p.grid_thw)
    height, width, seconds, fps = size
    indices = sample_frame_indices(seconds * fps, float(fps), VideoPreprocessConfig())
    frames = synthetic_rgb(height, width, seed, frames=len(indices))
    p = process_video(DecodedVideo(frames, indices, float(fps), seconds * fps))
    return p.pixel_values, tuple(p.grid_thw)


def tower_flops(v: dict, grid: tuple[int, int, int]) -> dict:
    """FLOPs of one tower call on ``grid``: linear layers at 2 per multiply-add, attention 4 * hidden * sum(L^2)
    per block (a frame of h*w patches is one segment)."""
    t, h, w = grid
    n, d, f, m2 = t * h * w, v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"] ** 2
    patch_in = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    per_row = d * 3 * d + d * d + 2 * d * f
    linear = 2 * n * patch_in * d + 2 * n * per_row * v["depth"]
    linear += 2 * (n // m2) * (m2 * d) * (m2 * d) + 2 * (n // m2) * (m2 * d) * v["out_hidden_size"]
    attention = 4 * d * t * (h * w) ** 2 * v["depth"]
    return {"linear": linear, "attention": attention, "total": linear + attention}


# -- timing ----------------------------------------------------------------------------------------
class Timer:
    """Times a callable on the device: CUDA events around the call (host gaps inside it count), or perf_counter
    on the CPU; warm-up runs first, then up to ``repeats`` runs while ``deadline`` (perf_counter) allows."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def once(self, fn) -> float:
        """Seconds of one call."""
        self.sync()
        if self.cuda:
            a, b = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def median(self, fn, repeats: int, deadline: float, warmup: int = 1) -> dict:
        warm = [self.once(fn) for _ in range(warmup)]
        samples = [self.once(fn)]
        while len(samples) < repeats and time.perf_counter() + samples[-1] < deadline:
            samples.append(self.once(fn))
        return {"ms": statistics.median(samples) * 1e3, "samples_ms": [s * 1e3 for s in samples],
                "warmup_ms": [s * 1e3 for s in warm]}


def encode_one(args, tower, model, timer, row: dict, kind: str, pixels, grid, peak: float) -> None:
    """Times our tower and transformers' on one input's pixel rows (device-resident, run dtype) into ``row``."""
    import torch

    x = pixels.to(timer.device, tower.dtype)
    grid_t = torch.tensor([grid], device=timer.device)
    deadline = time.perf_counter() + min(30.0, max(5.0, remaining(args) / 4))

    def ours():
        return tower.encode(x, [grid])

    def hf():
        with torch.no_grad():
            if kind == "image":
                out = model.model.get_image_features(pixel_values=x, image_grid_thw=grid_t)
            else:
                out = model.model.get_video_features(pixel_values_videos=x, video_grid_thw=grid_t)
        return torch.cat(list(out.pooler_output))

    for who, fn in (("ours", ours), ("hf", hf)):
        try:
            with Phase(f"encode {row['input']} {who}", sync=timer.sync):
                r = timer.median(fn, args.repeats, deadline)
            r["peak_fraction"] = row["flops"]["total"] / (r["ms"] / 1e3) / peak
            row[who] = r
            log(f"encode {row['input']} {who}: {r['ms']:.2f} ms, {r['peak_fraction']:.1%} of the matmul peak")
        except Exception as exc:  # noqa: BLE001 - record and go on with the other side
            row[f"{who}_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    if "ours" in row and "hf" in row:
        row["hf_over_ours"] = row["hf"]["ms"] / row["ours"]["ms"]
        # The same work on both sides: the merged embeddings agree up to the run dtype's rounding.
        a, b = ours().float(), hf().float()
        row["max_abs_diff"] = float((a - b).abs().max())
        row["max_abs_hf"] = float(b.abs().max())


def encode_rows(args, engine, model, timer, inputs, peak: float, summary: dict, save) -> None:
    import torch

    tower = engine._program.tower  # noqa: SLF001 (the tower the engine runs)
    vcfg = summary["config"]["vision"]
    for i, (name, kind, size) in enumerate(inputs):
        row = {"input": name, "kind": kind}
        summary["encode"].append(row)
        if remaining(args) < 15:
            row["error"] = "skipped: the time budget ran out"
            log(f"encode {name}: skipped (budget)")
            continue
        try:
            with Phase(f"inputs {name}"):
                pixels, grid = processed(kind, size, seed=args.seed + i)
            row.update(grid=list(grid), patches=int(pixels.shape[0]), tokens=int(pixels.shape[0]) // 4,
                       flops=tower_flops(vcfg, grid))
            encode_one(args, tower, model, timer, row, kind, pixels, grid, peak)
        except Exception as exc:  # noqa: BLE001 - the row records it, the other inputs still run
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        if timer.cuda:
            torch.cuda.empty_cache()
        save()


def ttft(args, engine, model, timer, summary: dict, save) -> None:
    import torch
    from ninfer.contracts.events import GenerationDelta
    from PIL import Image

    out = summary["ttft"]
    h, w = TTFT_IMAGE
    picture = Image.fromarray(synthetic_rgb(h, w, seed=args.seed + 100))
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": QUESTION}]}]
    t0 = time.perf_counter()
    prompt = engine.frontend.prepare_chat(messages, enable_thinking=False)
    out.update(image=f"{w}x{h}", prepare_chat_ms=(time.perf_counter() - t0) * 1e3,
               prompt_tokens=len(prompt.token_ids), image_grid=list(prompt.media[0].grid),
               image_tokens=sum(b - a for a, b in prompt.media[0].spans))
    params = engine.sampling_params(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ours_turn() -> float:
        t = time.perf_counter()
        first = None
        with engine.submit(prompt, sampling=params) as handle:
            for event in handle:
                if first is None and isinstance(event, GenerationDelta) and event.token_ids:
                    first = time.perf_counter() - t
        if first is None:
            raise RuntimeError("the turn ended without a token")
        return first

    ids = list(prompt.token_ids)
    types = [0] * len(ids)
    for a, b in prompt.media[0].spans:
        types[a:b] = [1] * (b - a)
    dev = timer.device
    inputs = {"input_ids": torch.tensor([ids], device=dev), "mm_token_type_ids": torch.tensor([types], device=dev),
              "attention_mask": torch.ones(1, len(ids), dtype=torch.int64, device=dev),
              "pixel_values": prompt.media[0].pixels.to(dev, model.dtype),
              "image_grid_thw": torch.tensor([list(prompt.media[0].grid)], device=dev)}

    def hf_turn() -> float:
        model.model.rope_deltas = None
        timer.sync()
        t = time.perf_counter()
        with torch.no_grad():
            got = model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None)
        timer.sync()
        elapsed = time.perf_counter() - t
        if got.shape[1] != len(ids) + 1:
            raise RuntimeError(f"generate made {got.shape[1] - len(ids)} tokens, not 1")
        return elapsed

    for who, fn in (("ours", ours_turn), ("hf", hf_turn)):
        if remaining(args) < 10:
            out[f"{who}_error"] = "skipped: the time budget ran out"
            continue
        try:
            with Phase(f"ttft {who}", sync=timer.sync):
                warm = fn()
                deadline = time.perf_counter() + min(40.0, max(5.0, remaining(args) / 3))
                samples = [fn()]
                while len(samples) < args.ttft_repeats and time.perf_counter() + samples[-1] < deadline:
                    samples.append(fn())
            out[who] = {"ms": statistics.median(samples) * 1e3, "samples_ms": [s * 1e3 for s in samples],
                        "warmup_ms": warm * 1e3}
            log(f"ttft {who}: {out[who]['ms']:.1f} ms (warm-up {warm * 1e3:.1f} ms)")
        except Exception as exc:  # noqa: BLE001 - record and go on
            out[f"{who}_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        save()
    if "ours" in out and "hf" in out:
        out["hf_over_ours"] = out["hf"]["ms"] / out["ours"]["ms"]


# -- report ----------------------------------------------------------------------------------------
def print_table(s: dict) -> None:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    lim = s.get("limits") or {}
    print(f"\n== Qwen3.5 vision tower {s['config']['vision_summary']}; text {s['config']['text_summary']}")
    if lim:
        print(f"matmul peak ({lim['dtype']}, n={lim['n']}): {lim['flops_per_s'] / 1e12:,.1f} TFLOP/s; "
              f"transformers {s.get('transformers')} ({s.get('hf_gdn')}; attention {s.get('hf_attn')})")
    print("\n| input | grid (t,h,w) | patches | GFLOP (attention) | ours ms | of peak | transformers ms | of peak "
          "| transformers / ours | max abs diff (of max) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in s["encode"]:
        o, h, f = r.get("ours") or {}, r.get("hf") or {}, r.get("flops") or {}
        gf = f"{f['total'] / 1e9:,.4g} ({f['attention'] / 1e9:,.4g})" if f else "-"
        print(f"| {r['input']} | {tuple(r['grid']) if 'grid' in r else '-'} | {fmt(r.get('patches'), ',')} | {gf} "
              f"| {fmt(o.get('ms'), ',.2f')} | {fmt(o.get('peak_fraction'), '.1%')} | {fmt(h.get('ms'), ',.2f')} "
              f"| {fmt(h.get('peak_fraction'), '.1%')} | {fmt(r.get('hf_over_ours'), '.2f')} "
              f"| {fmt(r.get('max_abs_diff'), '.2g')} ({fmt(r.get('max_abs_hf'), '.2g')}) |")
    t = s["ttft"]
    if t:
        print(f"\nTTFT, chat turn with one {t.get('image')} image ({t.get('image_tokens')} image tokens of "
              f"{t.get('prompt_tokens')}; prepare_chat {fmt(t.get('prepare_chat_ms'), ',.1f')} ms, not counted):")
        print("| | ours ms | transformers ms | transformers / ours |\n|---|---|---|---|")
        print(f"| TTFT | {fmt((t.get('ours') or {}).get('ms'), ',.1f')} | {fmt((t.get('hf') or {}).get('ms'), ',.1f')} "
              f"| {fmt(t.get('hf_over_ours'), '.2f')} |")
    print("\nphases: " + ", ".join(f"{k} {v:.1f}s" for k, v in s["phases_s"].items()))
    for e in s["errors"]:
        print(f"error: {e}")


# -- main ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.budget_s + 60, exit=True)   # a hung step cannot outlive the budget
    if args.hf_path == "torch":
        sys.modules.setdefault("fla", None)   # transformers then binds its torch GDN and conv functions
        sys.modules.setdefault("causal_conv1d", None)
    import torch
    import transformers
    from ninfer import Engine, EngineOptions
    from ninfer.bench.limits import measure_matmul_peak

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    args.out.mkdir(parents=True, exist_ok=True)
    text, vision = configs(args)
    summary = {"tiny": args.tiny, "device": torch.cuda.get_device_name(device) if timer.cuda else "cpu",
               "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
               "transformers": transformers.__version__, "hf_path": args.hf_path,
               "config": {"text": {k: v for k, v in text.items() if k != "layer_types"}, "vision": vision,
                          "text_summary": f"hidden {text['hidden_size']}, {text['num_hidden_layers']} layers "
                                          f"(published 9B: {SHAPES['9b']['num_hidden_layers']})",
                          "vision_summary": f"depth {vision['depth']}, hidden {vision['hidden_size']}, MLP "
                                            f"{vision['intermediate_size']}, {vision['num_heads']} heads, patch "
                                            f"{vision['patch_size']}, out {vision['out_hidden_size']}"},
               "limits": None, "encode": [], "ttft": {}, "phases_s": PHASES, "errors": []}
    path = args.out / "vision_speed.json"

    def save() -> None:
        path.write_text(json.dumps(summary, indent=1, default=str))

    work = args.work or Path(tempfile.mkdtemp(prefix="ninfer_vision_"))
    folder, artifact = work / "src", work / "vision.ninfer"
    folder.mkdir(parents=True, exist_ok=True)
    conversion, engine = None, None
    try:
        with Phase("matmul peak", sync=timer.sync):
            n = 8192 if timer.cuda else 1024
            summary["limits"] = {"flops_per_s": measure_matmul_peak(device, dtype, n), "n": n,
                                 "dtype": summary["dtype"]}
        with Phase("build", sync=timer.sync):
            model = build_hf(text, vision, device, dtype, args.seed)
        summary["parameters"] = sum(p.numel() for p in model.parameters())
        summary["hf_attn"] = {"text": getattr(model.config.text_config, "_attn_implementation", None),
                              "vision": getattr(model.config.vision_config, "_attn_implementation", None)}
        if args.hf_path == "torch":
            force_torch_path(sys.modules[type(model).__module__])
        summary["hf_gdn"] = gdn_path(kernel_paths(sys.modules[type(model).__module__]))
        log(f"model: {summary['parameters'] / 1e9:.3f} B parameters ({vision['depth']}-block tower)")
        write_frontend(folder)
        with Phase("convert"):
            conversion = convert_in_memory(model, folder, artifact, "qwen3_5-9b-vision-shape")
        summary["artifact_bytes"] = sum(Path(p).stat().st_size for p in conversion["paths"])
        save()
        if timer.cuda:
            torch.cuda.empty_cache()
        with Phase("engine start", sync=timer.sync):
            engine = Engine.start(artifact, EngineOptions(
                device=args.device, dtype=summary["dtype"], max_concurrency=1, max_context=4096,
                context_cache=False, vision=True))
        encode_rows(args, engine, model, timer, INPUTS,
                    summary["limits"]["flops_per_s"], summary, save)
        ttft(args, engine, model, timer, summary, save)
    except Exception as exc:  # noqa: BLE001 - the JSON keeps what was measured
        summary["errors"].append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        if engine is not None:
            engine.close()
        if not args.keep_artifact:
            shutil.rmtree(work, ignore_errors=True) if args.work is None else \
                [Path(p).unlink(missing_ok=True) for p in (conversion or {}).get("paths", [])]
        save()
        faulthandler.cancel_dump_traceback_later()
    print_table(summary)
    log(f"summary: {path}")
    complete = all("ours" in r and "hf" in r for r in summary["encode"]) and len(summary["encode"]) == 4 \
        and "ours" in summary["ttft"] and "hf" in summary["ttft"]
    return 0 if complete and not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
