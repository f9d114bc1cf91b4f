#!/usr/bin/env python3
"""GPU benchmark at the published Qwen3.5 and Qwen4-Exp shapes (random bf16 weights): `ninfer bench` through the
public Engine, and Hugging Face transformers on the same weights in the same run (issue #8 item 4, issue #35 item 4).

Phases (each timed and printed; a summary JSON goes under ``--out``):

1. build a random transformers model directly in bf16 on the device (never fp32: 35B-A3B would not fit),
   with the init conventions of tools/gpu_qwen3_5_check.py's build_hf: A_log = log U(0.1, 2),
   dt_bias U(-1, 1), GDN gated-norm weights U(0.5, 1.5), other 1-d weights U(-0.5, 0.5), matrices
   N(0, 1/fan_in);
2. write the NInfer artifact. Default route ``memory``: the plugin's source mapping plans the conversion
   from the model's state_dict and the conversion pipeline (``ninfer.conversion``) writes the bytes from
   device memory (through a pinned staging buffer); no Hugging Face folder is written, so the disk holds one
   copy. Route ``disk`` (also the automatic fallback if ``memory`` fails): save_pretrained, convert, delete
   the source.
   Both add the frontend resources of tools/gpu_bench_0_8b.py (``--tokenizer`` tokenizer.json, our EOS
   tokenizer_config, Qwen's generation_config EOS ids);
3. ``ninfer bench ART --batches 1,2,4,8 --prefill-lengths 1024,8192,32768`` in a subprocess (the
   transformers model stays resident, idle, on the device; the engine plans from free memory);
4. transformers on the same weights: prefill tok/s (one forward of random ids, ``logits_to_keep=1``, cache
   on; warm-up then the median), and greedy decode tok/s with ``model.generate`` by the method of
   ``ninfer bench`` (prompt 128, runs of base and base + steps new tokens, ``min_new_tokens`` so every run
   has exactly that many; rate = B * steps / (T_long - T_short)). It records which implementation each
   GDN/conv entry point resolved to (flash-linear-attention's ``fla`` and ``causal_conv1d`` when importable,
   else transformers' torch fallback); if the kernel path raises, it reruns on the torch path and says so;
5. summary: our figures, transformers', both as ratios to the limits ``ninfer bench`` measured (copy
   bandwidth, bf16 matmul peak; bytes and FLOPs from the artifact's ModelProfile), and ours / transformers.

Shapes (text model only; vocabulary 248,320; head dim 256 with partial rotary 0.25, rope theta 1e7,
interleaved mrope [11, 11, 10]; GDN key/value head dim 128, conv kernel 4; one full-attention layer
every 4th, the other three Gated DeltaNet; rms eps 1e-6):

| shape | hidden | layers | attention q/kv heads | GDN qk/v heads | FFN | tied |
|---|---|---|---|---|---|---|
| 0.8b | 1024 | 24 | 8 / 2 | 16 / 16 | 3584 | yes |
| 9b | 4096 | 32 | 16 / 4 | 16 / 32 | 12288 | no |
| 35b-a3b | 2048 | 40 (default here 12) | 16 / 2 | 16 / 32 | 256 experts top-8 of 512, shared expert 512 | no |
| qwen4exp | 2560 | 48 (default here 8) | 24 / 2 | 16 / 48 | 512 experts top-10 of 640, shared 640 | no |

Qwen4-Exp (Qwen3.8-Flash-Next's text model): 4 residual streams (rank-320 mixers), PLE on layer 2 (trigrams, 8 hash
heads per order), QSA on every 4th layer (4 indexer heads of 128, blocks of 4, 512 kept), vocabulary 248,320,
rotary 64 of 256. Two changes from the published config: 8 of 48 layers by default (a layer's experts are 5 GB in
bf16; 8 layers are ~44 GB, which the 64 GiB disk and, with transformers' copy beside ours, the GPU hold), and PLE
prime sizes from 200,003 instead of 20,000,000 (a ~1 GB table instead of ~100 GB; a step gathers the same 16 rows
a token whatever the table's size).

Sources: the Qwen3.5-0.8B / -9B / -35B-A3B model cards (hidden layout, heads, FFN / expert widths, layer
counts), the Qwen3.5-9B config.json as re-published by derivatives (layer_types, linear heads,
intermediate size) and transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults, which are the 9B
and 35B-A3B text configs. Tying: 0.8B tied (as in tools/gpu_qwen3_5_check.py), 9B and 35B-A3B untied
(transformers' defaults for those configs).

35B-A3B runs with fewer layers by default (12 of 40: 9 GDN + 3 attention, ~22 GB bf16) so that a one-GPU
device's 64 GiB disk, its memory and the 10-minute command limit hold; every per-layer shape stays published. The
whole published model (69.3 GB) runs on a two-GPU machine (128 GiB disk) with transformers on the second GPU, in
~5.5 minutes: ``--layers 40 --device cuda:0 --hf-device cuda:1`` (docs/benchmarks.md, Reproduce).
Decode figures are also given against the bytes a step actually reads (an untied embedding table: B rows; a MoE:
the expected distinct experts of B random top-8 routings) when the report's byte count takes every resident weight
byte (reports of older ``ninfer bench`` builds, docs/benchmarks.md; it now counts the bytes read itself, and the
extra column stays empty).

    python3 tools/gpu_bench_shapes.py --shape 9b --tokenizer .gpu_assets/tokenizer.json --out $OUT
    python3 tools/gpu_bench_shapes.py --shape 35b-a3b --layers 12 --tokenizer .gpu_assets/tokenizer.json --out $OUT
    python3 tools/gpu_bench_shapes.py --shape qwen4exp --tokenizer .gpu_assets/tokenizer.json --out $OUT
    python3 tools/gpu_bench_shapes.py --tiny --device cpu --tokenizer .gpu_assets/tokenizer.json --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

START = time.perf_counter()
PHASES: dict[str, float] = {}

ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
            mrope_interleaved=True)
_COMMON = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, rope_parameters=ROPE, max_position_embeddings=262144, rms_norm_eps=1e-6,
               hidden_act="silu")
SHAPES = {
    "0.8b": dict(_COMMON, kind="dense", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=3584,
                 tie_word_embeddings=True),
    "9b": dict(_COMMON, kind="dense", hidden_size=4096, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=12288,
               tie_word_embeddings=False),
    "35b-a3b": dict(_COMMON, kind="moe", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
                    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                    tie_word_embeddings=False),
}
# Qwen4-Exp (Qwen3.8-Flash-Next, docs/architectures/qwen4exp.md) with one change: the PLE table's per-head prime
# sizes start at 200,003 instead of 20,000,000 (3.2 M rows, ~1 GB, instead of 320 M rows, ~100 GB, which neither the
# device's 64 GiB disk nor its host memory holds); a PLE step gathers 16 rows a token whatever the table's size.
SHAPES["qwen4exp"] = dict(
    _COMMON, kind="qwen4exp", hidden_size=2560, num_hidden_layers=48, num_attention_heads=24, num_key_value_heads=2,
    linear_num_key_heads=16, linear_num_value_heads=48, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=640, shared_expert_intermediate_size=640, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25), hc_count=4, hc_lowrank=320,
    ple_layer_ids=[2], ple_embed_dim=2560, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=200_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=128, indexer_n_heads=4,
    indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, output_gate_type="sigmoid",
    eos_token_id=248046)
DEFAULT_LAYERS = {"0.8b": 24, "9b": 32, "35b-a3b": 12, "qwen4exp": 8}
FAMILY = {"0.8b": "Qwen3.5", "9b": "Qwen3.5", "35b-a3b": "Qwen3.5", "qwen4exp": "Qwen4-Exp"}
_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             rope_parameters=dict(ROPE, mrope_section=[1, 1, 0]))
TINY = {
    "0.8b": dict(SHAPES["0.8b"], **_TINY, intermediate_size=96),
    "9b": dict(SHAPES["9b"], **_TINY, intermediate_size=96),
    "35b-a3b": dict(SHAPES["35b-a3b"], **_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32),
    "qwen4exp": dict(SHAPES["qwen4exp"], **_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32, hc_lowrank=8, ple_embed_dim=64, ngram_vocab_size_base=50,
                     make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2, indexer_head_dim=16,
                     indexer_budget=8),
}
TINY["qwen4exp"]["rope_parameters"] = dict(SHAPES["qwen4exp"]["rope_parameters"])
# Frontend resources an Engine needs (as tools/gpu_bench_0_8b.py): our EOS, Qwen's generation EOS ids.
TOKENIZER_CONFIG = {"eos_token": "<|im_end|>"}
GENERATION_CONFIG = {"eos_token_id": [248046, 248044]}
KERNEL_ENTRY_POINTS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                       "causal_conv1d_update")
_ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64", "int32": "I32"}


LOG_TAG = "shapes"   # the progress lines' tag; tools that reuse log and Phase set their own


def log(msg: str) -> None:
    print(f"[{LOG_TAG} {time.perf_counter() - START:7.1f}s] {msg}", flush=True)


class Phase:
    """Times a phase into PHASES and prints its start and end."""

    def __init__(self, name: str, sync=None) -> None:
        self.name, self.sync = name, sync

    def __enter__(self):
        log(f"{self.name} ...")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.sync is not None and exc_type is None:
            self.sync()
        PHASES[self.name] = PHASES.get(self.name, 0.0) + time.perf_counter() - self.t0
        log(f"{self.name}: {'failed' if exc_type else 'done'} in {time.perf_counter() - self.t0:.1f} s")
        return False


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (default: published; "
                    "35b-a3b: 12)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="a Qwen3.5 tokenizer.json")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--device", default="cuda", help="where `ninfer bench` runs (and transformers, unless --hf-device)")
    ap.add_argument("--hf-device", default=None, help="where the transformers model is built, converted from and "
                    "run (default: --device); e.g. cuda:1 on a two-GPU machine, so that the published 35B-A3B "
                    "(~70 GB) and our engine's copy each have a GPU")
    ap.add_argument("--tiny", action="store_true", help="tiny widths, few tokens: a CPU smoke run of everything")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--convert", choices=("memory", "disk"), default="memory",
                    help="memory: stream the state_dict into the writer; disk: save_pretrained + ninfer-convert")
    ap.add_argument("--work", type=Path, default=None, help="folder for the artifact (default: a temp folder)")
    ap.add_argument("--keep-artifact", action="store_true")
    g = ap.add_argument_group("ninfer bench")
    g.add_argument("--batches", default=None, help="default 1,2,4,8 (tiny: 1,2)")
    g.add_argument("--prefill-lengths", default=None, help="default 1024,8192,32768 (tiny: 32,64)")
    g.add_argument("--bench-args", default="", help="more `ninfer bench` arguments, e.g. '--repeats 2'")
    g.add_argument("--no-ours", action="store_true", help="skip `ninfer bench`")
    h = ap.add_argument_group("transformers")
    h.add_argument("--no-hf", action="store_true", help="skip the transformers runs")
    h.add_argument("--hf-path", choices=("auto", "torch"), default="auto",
                   help="auto: fla / causal_conv1d kernels when importable (never on a CPU device); torch: "
                        "transformers' torch fallback")
    h.add_argument("--hf-batches", default=None, help="decode batches (default 1,8; tiny: 1,2)")
    h.add_argument("--hf-prefill-lengths", default=None, help="default 1024,8192 (tiny: 32,64)")
    h.add_argument("--hf-prompt", type=int, default=None, help="decode prompt tokens (default 128; tiny 16)")
    h.add_argument("--hf-base", type=int, default=None, help="short-run new tokens (default 8; tiny 2)")
    h.add_argument("--hf-steps", type=int, default=None, help="measured decode steps (default 64; tiny 4)")
    h.add_argument("--hf-repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-clock budget of the whole script: `ninfer bench` gets what is left minus "
                         "--hf-reserve-s, transformers runs stop starting new cases when the budget runs out")
    ap.add_argument("--hf-reserve-s", type=float, default=100.0)
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.batches = args.batches or ("1,2" if tiny else "1,2,4,8")
    args.prefill_lengths = args.prefill_lengths or ("32,64" if tiny else "1024,8192,32768")
    args.hf_batches = _ints(args.hf_batches or ("1,2" if tiny else "1,8"))
    args.hf_prefill_lengths = _ints(args.hf_prefill_lengths or ("32,64" if tiny else "1024,8192"))
    args.hf_prompt = args.hf_prompt or (16 if tiny else 128)
    args.hf_base = args.hf_base or (2 if tiny else 8)
    args.hf_steps = args.hf_steps or (4 if tiny else 64)
    if tiny and not args.bench_args:
        args.bench_args = "--decode-prompt-tokens 16 --decode-base-tokens 2 --decode-steps 4 --repeats 1"
    if args.hf_path == "auto" and not args.device.startswith("cuda"):
        args.hf_path = "torch"  # fla beside transformers breaks its CPU forward: never import it off CUDA
    return args


def remaining(args) -> float:
    return args.budget_s - (time.perf_counter() - START)


# -- model -----------------------------------------------------------------------------------------
def geometry_for(args) -> dict:
    base = (TINY if args.tiny else SHAPES)[args.shape]
    layers = args.layers or (4 if args.tiny else DEFAULT_LAYERS[args.shape])
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return dict(base, num_hidden_layers=layers, layer_types=types)


def random_model(make, device, dtype, seed: int, norms: tuple[str, ...] = ("linear_attn.norm.weight",)):
    """``make()`` built in ``dtype`` directly on ``device``, with random weights that give O(1) activations:
    matrices N(0, 1/fan_in) (a convolution's fan-in is all its input dims), vectors U(-0.5, 0.5) (zero-centred
    norms), the plain norms named by ``norms`` U(0.5, 1.5), A_log = log U(0.1, 2), dt_bias U(-1, 1)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = make()
    finally:
        torch.set_default_dtype(previous)
    for p in model.parameters():  # parameters only: buffers (rotary inv_freq) keep transformers' dtype
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.1, 2.0, generator=g).log_()
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0, generator=g)
            elif name.endswith(norms):
                p.uniform_(0.5, 1.5, generator=g)
            elif p.ndim == 1:
                p.uniform_(-0.5, 0.5, generator=g)
            else:
                fan_in = p[0].numel() if p.ndim >= 4 else p.shape[-1]
                p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=g)
    return model


def build_hf(geometry: dict, device, seed: int):
    """A random transformers model built in bf16 directly on ``device``."""
    import torch
    import transformers as tf

    cfg = {k: v for k, v in geometry.items() if k != "kind"}
    if geometry["kind"] == "dense":
        cls, config = tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**cfg)
    elif geometry["kind"] == "qwen4exp":
        cls, config = tf.Qwen4ExpForCausalLM, tf.Qwen4ExpTextConfig(**cfg)
    else:
        cls, config = tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(**cfg)
    model = random_model(lambda: cls(config), device, torch.bfloat16, seed)
    if geometry["tie_word_embeddings"]:
        model.tie_weights()
    model.config.architectures = [cls.__name__]
    return model.eval()


def unique_state_dict(model) -> dict:
    """state_dict without tied duplicates (the first name of a storage wins: the embedding before the head)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def weight_stats(model, geometry: dict) -> dict:
    sd = unique_state_dict(model)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    experts = sum(t.numel() * t.element_size() for n, t in sd.items() if ".mlp.experts." in n)
    embed = sum(t.numel() * t.element_size() for n, t in sd.items() if n.endswith("embed_tokens.weight"))
    return {"parameters": sum(t.numel() for t in sd.values()), "bytes": total, "expert_bytes": experts,
            "embedding_bytes": embed, "tied": bool(geometry["tie_word_embeddings"])}


def write_frontend(folder: Path, tokenizer: Path) -> None:
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))


# -- conversion ------------------------------------------------------------------------------------
def convert_in_memory(model, folder: Path, artifact: Path, name: str, quantize: str | None = None,
                      extra: dict | None = None, draft: Path | None = None) -> dict:
    """ninfer-convert's plan, check and writer, fed from the model's tensors instead of safetensors files
    (convert.convert's steps, with the source reads replaced). ``folder`` holds config.json and the
    frontend resources. ``quantize``: a recipe (``ninfer-convert --quantize``), encoded by the converter's own
    encoders; the result then lists each quantized object's stored and source bytes. ``extra``: more checkpoint
    tensors by name (e.g. an MTP head's ``mtp.*``, declared in ``model.config`` by the caller). ``draft``: a
    drafter folder attached as ``ninfer-convert --draft`` attaches it (``ninfer.conversion.draft``); its tensors
    are read from its safetensors files."""
    import dataclasses
    import io
    from types import MappingProxyType

    import torch
    from ninfer.artifact.source_mapping import SourceRows, SourceTensor
    from ninfer.artifact.writer import ArtifactWriter
    from ninfer.conversion import pipeline as cv
    from ninfer.conversion.cast import cast_chunk
    from ninfer.conversion.plan import CheckedPlan, check_plan
    from ninfer.conversion.quantize import write_quantized
    from ninfer.conversion.recipe import assign, load_recipe
    from ninfer.conversion.resources import collect_resources
    from ninfer.conversion.source import SourceCheckpoint, TensorLocation
    from ninfer.plugins import get_registry

    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    sd = {**unique_state_dict(model), **(extra or {})}
    tensors = {n: SourceTensor(n, tuple(t.shape), _ST_DTYPE[str(t.dtype).removeprefix("torch.")])
               for n, t in sd.items()}
    locations = {n: TensorLocation("<memory>", 0, t.numel() * t.element_size()) for n, t in sd.items()}
    ckpt = SourceCheckpoint(folder=folder, config=MappingProxyType(config), weight_files=(), index=None,
                            tensors=MappingProxyType(tensors), locations=MappingProxyType(locations))
    mapping = get_registry().source_mapping(ckpt.architecture)
    plan, draft_record = cv._run_mapping(mapping, ckpt), None
    if draft is not None:
        from ninfer.conversion.draft import DRAFT_PREFIX, attach_draft
        from safetensors.torch import load_file

        plan, ckpt, draft_record = attach_draft(mapping, plan, ckpt, draft)
        for f in ckpt.weight_files:   # the merged checkpoint's files are the draft's
            sd.update({DRAFT_PREFIX + n: t for n, t in load_file(str(f.path)).items()})
    checked = check_plan(plan, ckpt.tensors)
    recipe = load_recipe(quantize) if quantize else None
    if recipe is not None:
        formats = assign(recipe, checked.plan, {o.id: o.shape for o in checked.objects})
        checked = CheckedPlan(checked.plan, tuple(dataclasses.replace(o, format=formats[o.id], cast=True)
                                                  if o.id in formats else o for o in checked.objects))
    quantized: dict[str, dict] = {}
    resources = collect_resources(folder, {c.id for c in checked.plan.components})
    chunk = 4 * cv.CHUNK_BYTES
    cuda = any(t.device.type == "cuda" for t in sd.values())
    staging = torch.empty(chunk, dtype=torch.uint8, pin_memory=True) if cuda else None
    writer = ArtifactWriter(artifact)
    written = 0
    try:
        cv._declare(writer, checked, resources, ckpt, mapping.name, name, recipe, draft_record)
        writer.begin_payload()
        for o in checked.objects:
            if o.quantized:
                tensors = [sd[src.name][src.begin:src.end] if isinstance(src, SourceRows) else sd[src]
                           for src in o.sources]
                spans = ((getattr(src, "name", src), io.BytesIO(t.detach().contiguous().cpu().view(-1)
                          .view(torch.uint8).numpy().tobytes()), 0, t.numel() * t.element_size())
                         for src, t in zip(o.sources, tensors, strict=True))
                stored = write_quantized(lambda data, oid=o.id: writer.write(oid, data), o.id, o.format, o.dtype,
                                         o.shape[-1], spans, cv.CHUNK_BYTES, lambda n: None,
                                         recipe.method == "search", device="cuda" if cuda else "cpu")
                source = sum(t.numel() * t.element_size() for t in tensors)
                quantized[o.id] = {"format": o.format, "stored_bytes": stored, "source_bytes": source}
                written += source
                continue
            for src in o.sources:
                t = sd[src.name][src.begin:src.end] if isinstance(src, SourceRows) else sd[src]
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                for off in range(0, flat.numel(), chunk):
                    piece = flat[off:off + chunk]
                    if piece.device.type != "cpu":
                        buf = staging[:piece.numel()]
                        buf.copy_(piece)  # synchronous: the writer reads the buffer before the next copy
                        piece = buf
                    data = cast_chunk(bytearray(piece.numpy().tobytes()), o.dtype, o.format, o.id) if o.cast \
                        else piece
                    writer.write(o.id, data)
                    written += piece.numel()
        for r in resources:
            writer.write(r.object_id, r.read())
        paths = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {"route": "memory", "paths": [str(p) for p in paths], "tensor_bytes": written,
            "objects": len(checked.objects), "casts": [o.id for o in checked.casts if not o.quantized],
            "quantize": quantize, "quantized": quantized}


def convert_on_disk(model, folder: Path, artifact: Path, name: str) -> dict:
    from ninfer.conversion import convert

    src = folder / "hf"
    src.mkdir()
    t0 = time.perf_counter()
    model.save_pretrained(src)
    saved = time.perf_counter() - t0
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(folder / f, src / f)
    try:
        result = convert(src, artifact, name=name, progress=False)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return {"route": "disk", "paths": [str(p) for p in result.paths], "tensor_bytes": result.tensor_bytes,
            "objects": result.objects, "casts": list(result.casts), "save_pretrained_s": saved}


# -- transformers ----------------------------------------------------------------------------------
def _implementation(fn):
    """The callable transformers' use_kernel_func_from_hub_with_fallback bound for ``fn`` (its closure cell
    ``implementation``), following __wrapped__ and closures; None when not found."""
    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
        if code is not None:
            for var, cell in zip(code.co_freevars, cells, strict=False):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if var == "implementation" and callable(value):
                    return value
                if callable(value):
                    todo.append(value)
        todo.append(getattr(f, "__wrapped__", None))
    return None


def kernel_paths(module) -> dict:
    import inspect

    out = {}
    for name in KERNEL_ENTRY_POINTS:
        fn = getattr(module, name, None)
        if fn is None:
            out[name] = "absent"
            continue
        impl = _implementation(fn) or inspect.unwrap(fn)  # no wrapper: the function itself runs
        out[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"
    return out


def gdn_path(paths: dict) -> str:
    gdn = paths.get("torch_chunk_gated_delta_rule", "")
    conv = paths.get("causal_conv1d_fn", "")
    gdn_kind = "fla" if gdn.startswith("fla") else ("torch fallback" if "transformers" in gdn else gdn)
    conv_kind = "causal_conv1d" if conv.startswith("causal_conv1d") else \
        ("torch conv1d fallback" if "transformers" in conv else conv)
    return f"GDN: {gdn_kind}; conv: {conv_kind}"


def force_torch_path(module) -> None:
    """Rebind the four kernel entry points to transformers' torch functions (module globals the GDN
    forward looks up at call time)."""
    import inspect

    for name in KERNEL_ENTRY_POINTS:
        fn = getattr(module, name, None)
        if fn is not None:
            setattr(module, name, inspect.unwrap(fn))


def _dist_version(name: str):
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


class HFBench:
    def __init__(self, model, device, args, vocab: int) -> None:
        import torch

        self.torch, self.model, self.device, self.args, self.vocab = torch, model, device, args, vocab
        self.gen = torch.Generator().manual_seed(args.seed + 11)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def ids(self, batch: int, length: int):
        return self.torch.randint(0, self.vocab, (batch, length), generator=self.gen).to(self.device)

    def timed(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def prefill(self, length: int) -> dict:
        torch = self.torch
        ids = self.ids(1, length)

        def run():
            with torch.no_grad():
                self.model(input_ids=ids, use_cache=True, logits_to_keep=1)

        warm = self.timed(run)  # compilation / autotuning
        samples = [self.timed(run) for _ in range(self.args.hf_repeats)]
        t = statistics.median(samples)
        return {"tokens": length, "tokens_per_s": length / t, "ttft_ms": t * 1e3, "samples_s": samples,
                "warmup_s": warm}

    def generate(self, prompts, new_tokens: int) -> float:
        torch = self.torch

        def run():
            with torch.no_grad():
                out = self.model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                          use_cache=True, pad_token_id=0)
            if out.shape[1] != prompts.shape[1] + new_tokens:
                raise RuntimeError(f"generate made {out.shape[1] - prompts.shape[1]} tokens, not {new_tokens}")

        return self.timed(run)

    def decode(self, batch: int) -> dict:
        a = self.args
        short_n, long_n = a.hf_base, a.hf_base + a.hf_steps
        warm = self.generate(self.ids(batch, a.hf_prompt), short_n)
        shorts, longs = [], []
        for _ in range(a.hf_repeats):
            shorts.append(self.generate(self.ids(batch, a.hf_prompt), short_n))
            longs.append(self.generate(self.ids(batch, a.hf_prompt), long_n))
        short_s, long_s = statistics.median(shorts), statistics.median(longs)
        if not long_s > short_s:
            raise RuntimeError(f"decode B={batch}: {long_n} tokens took {long_s:.4f} s <= {short_n} tokens "
                               f"({short_s:.4f} s)")
        step = (long_s - short_s) / a.hf_steps
        context = a.hf_prompt + short_n + (a.hf_steps - 1) / 2
        return {"batch": batch, "tokens_per_s": batch / step, "step_ms": step * 1e3, "context_tokens": context,
                "short_run_s": short_s, "long_run_s": long_s, "short_samples_s": shorts, "long_samples_s": longs,
                "warmup_s": warm}


def run_hf(model, device, args, vocab: int) -> dict:
    import torch
    import transformers

    module = sys.modules[type(model).__module__]
    if args.hf_path == "torch":
        force_torch_path(module)
    info = {"transformers": transformers.__version__, "requested_path": args.hf_path,
            "fla_core": _dist_version("fla-core"), "flash_linear_attention": _dist_version("flash-linear-attention"),
            "causal_conv1d": _dist_version("causal-conv1d"), "kernels": _dist_version("kernels"),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "cache_implementation": getattr(model.generation_config, "cache_implementation", None),
            "entry_points": kernel_paths(module), "errors": [], "prefill": [], "decode": []}
    info["path"] = gdn_path(info["entry_points"])
    log(f"transformers {transformers.__version__}: {info['path']} ({info['entry_points']})")
    bench = HFBench(model, device, args, vocab)
    cases = [("prefill", n) for n in args.hf_prefill_lengths] + [("decode", b) for b in args.hf_batches]
    for kind, n in cases:
        if remaining(args) < 20:
            info["errors"].append(f"{kind} {n}: skipped, the time budget ran out")
            log(f"transformers {kind} {n}: skipped (budget)")
            continue
        for attempt in (0, 1):
            try:
                with Phase(f"hf {kind} {n}", sync=bench.sync):
                    row = bench.prefill(n) if kind == "prefill" else bench.decode(n)
                info[kind].append(row)
                log(f"transformers {kind} {n}: {row['tokens_per_s']:,.1f} tok/s")
                break
            except Exception as exc:  # noqa: BLE001 - record, fall back to the torch path once, go on
                msg = f"{kind} {n} on {info['path']}: {type(exc).__name__}: {exc}"
                info["errors"].append(msg)
                log(f"transformers {msg}")
                traceback.print_exc()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if attempt == 0 and not info["path"].startswith("GDN: torch"):
                    force_torch_path(module)
                    info["entry_points_after_fallback"] = kernel_paths(module)
                    info["path"] = gdn_path(info["entry_points_after_fallback"]) + " (after a kernel-path error)"
                    log(f"transformers: rerunning on {info['path']}")
                    continue
                break
    return info


# -- ninfer bench ----------------------------------------------------------------------------------
def run_ours(artifact: Path, args) -> dict:
    out = args.out / f"ninfer_bench_{args.shape}.json"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", str(artifact), "--output", str(out),
           "--device", args.device, "--batches", args.batches, "--prefill-lengths", args.prefill_lengths,
           *(["--dtype", "bfloat16"] if args.device.startswith("cuda") else []), *shlex.split(args.bench_args)]
    timeout = max(60.0, remaining(args) - (0 if args.no_hf else args.hf_reserve_s))
    log(f"$ {' '.join(cmd)}  (timeout {timeout:.0f} s)")
    try:
        subprocess.run(cmd, check=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ninfer bench ran past its {timeout:.0f} s share of the budget", "command": cmd}
    except subprocess.CalledProcessError as exc:
        return {"error": f"ninfer bench exited {exc.returncode}", "command": cmd}
    return {"report": json.loads(out.read_text()), "json": str(out), "command": cmd}


# -- summary ---------------------------------------------------------------------------------------
def expected_distinct(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts of ``rows`` independent uniform top-k routings."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def summarize(args, geometry, weights, conversion, ours, hf) -> dict:
    report = ours.get("report") if ours else None
    limits = report["limits"] if report else None
    summary = {"shape": args.shape, "tiny": args.tiny, "layers": geometry["num_hidden_layers"],
               "published_layers": SHAPES[args.shape]["num_hidden_layers"],
               "geometry": {k: v for k, v in geometry.items() if k != "layer_types"}, "weights": weights,
               "conversion": conversion, "phases_s": dict(PHASES), "limits": limits,
               "ours": None, "hf": None, "ours_over_hf": {}}
    profile = None
    if report:
        try:
            from ninfer.bench.report import decode_step_bytes, prefill_flops
            from ninfer.contracts.architecture import ModelProfile

            fields = ModelProfile.__dataclass_fields__
            profile = ModelProfile(**{k: v for k, v in report["profile"].items() if k in fields})
        except Exception as exc:  # noqa: BLE001
            summary["profile_error"] = f"{type(exc).__name__}: {exc}"
    moe = "num_experts" in geometry

    def active_bytes(batch: int, step_bytes: float) -> float | None:
        # An untied input embedding is read one row per token, not whole (a tied one is the LM head: read whole);
        # a MoE reads the expected distinct experts of B random top-k routings. The bench's own byte count now
        # leaves those out (ModelProfile.embedding_bytes / routed_expert_bytes): then its figure is already the
        # active one.
        if profile is not None and (profile.embedding_bytes or profile.routed_expert_bytes):
            return None
        unread = 0.0 if weights["tied"] else weights["embedding_bytes"] * (1 - min(1.0, batch / geometry["vocab_size"]))
        if moe:
            e, k = geometry["num_experts"], geometry["num_experts_per_tok"]
            unread += weights["expert_bytes"] * (1 - expected_distinct(e, k, batch) / e)
        return step_bytes - unread if unread else None

    def decode_entry(batch, tok_s, step_ms, context):
        row = {"batch": batch, "tokens_per_s": tok_s, "step_ms": step_ms}
        if profile is not None and limits is not None:
            b = decode_step_bytes(profile, batch, context)
            row["bytes_per_step"] = b
            row["copy_bandwidth_ratio"] = b / (step_ms / 1e3) / limits["copy_bytes_per_s"]
            if limits.get("copy_bytes_per_s_after"):   # the same copy measured after the workload
                row["copy_bandwidth_ratio_after"] = b / (step_ms / 1e3) / limits["copy_bytes_per_s_after"]
            act = active_bytes(batch, b)
            if act is not None:
                row["active_bytes_per_step"] = act
                row["copy_bandwidth_ratio_active"] = act / (step_ms / 1e3) / limits["copy_bytes_per_s"]
                if limits.get("copy_bytes_per_s_after"):   # the same copy measured after the workload
                    row["copy_bandwidth_ratio_active_after"] = (act / (step_ms / 1e3)
                                                                / limits["copy_bytes_per_s_after"])
        return row

    def prefill_entry(tokens, tok_s, ttft_ms):
        row = {"tokens": tokens, "tokens_per_s": tok_s, "ttft_ms": ttft_ms}
        if profile is not None and limits is not None:
            f = prefill_flops(profile, tokens)
            row["flops"] = f
            row["matmul_peak_ratio"] = f / (ttft_ms / 1e3) / limits["matmul_flops_per_s"]
        return row

    if report:
        summary["ours"] = {
            "engine": report.get("engine"),
            "decode": [decode_entry(r["batch"], r["tokens_per_s"], r["step_ms"], r["context_tokens"])
                       | {"ttft_ms": r["ttft_ms"]} for r in report["decode"]],
            "prefill": [prefill_entry(r["tokens"], r["tokens_per_s"], r["ttft_ms"]) for r in report["prefill"]],
        }
    elif ours:
        summary["ours"] = {"error": ours.get("error")}
    if hf:
        summary["hf"] = {k: v for k, v in hf.items() if k not in ("prefill", "decode")}
        summary["hf"]["decode"] = [decode_entry(r["batch"], r["tokens_per_s"], r["step_ms"], r["context_tokens"])
                                   for r in hf["decode"]]
        summary["hf"]["prefill"] = [prefill_entry(r["tokens"], r["tokens_per_s"], r["ttft_ms"]) for r in hf["prefill"]]
    if summary["ours"] and summary["hf"] and "decode" in summary["ours"]:
        ratio = summary["ours_over_hf"]
        for h in summary["hf"]["decode"]:
            o = next((r for r in summary["ours"]["decode"] if r["batch"] == h["batch"]), None)
            if o:
                ratio[f"decode_B{h['batch']}_tok_s"] = o["tokens_per_s"] / h["tokens_per_s"]
        for h in summary["hf"]["prefill"]:
            o = next((r for r in summary["ours"]["prefill"] if r["tokens"] == h["tokens"]), None)
            if o:
                ratio[f"prefill_{h['tokens']}_tok_s"] = o["tokens_per_s"] / h["tokens_per_s"]  # = HF TTFT / ours
    return summary


def print_table(s: dict) -> None:
    lim = s["limits"]
    print(f"\n== {FAMILY[s['shape']]} {s['shape']} shape, {s['layers']} of {s['published_layers']} layers, "
          f"{s['weights']['bytes'] / 1e9:.2f} GB bf16 ({s['weights']['parameters'] / 1e9:.3f} B params)")
    if lim:
        after = lim.get("copy_bytes_per_s_after")
        print(f"limits: copy {lim['copy_bytes_per_s'] / 1e9:,.0f} GB/s"
              f"{'' if not after else f' ({after / 1e9:,.0f} after the workload)'}, {lim['matmul_dtype']} matmul "
              f"{lim['matmul_flops_per_s'] / 1e12:,.1f} TFLOP/s")
    if s["hf"]:
        print(f"transformers {s['hf'].get('transformers')}: {s['hf'].get('path')}")
    print("phases: " + ", ".join(f"{k} {v:.1f}s" for k, v in s["phases_s"].items()))

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    ours = s["ours"] if s["ours"] and "decode" in s["ours"] else {"decode": [], "prefill": []}
    hf = s["hf"] or {"decode": [], "prefill": []}
    print(f"\n{'decode':<8} {'ours tok/s':>11} {'of BW':>7} {'act BW':>7} {'(after)':>7} {'HF tok/s':>10} {'of BW':>7} "
          f"{'ours/HF':>8}")
    for b in sorted({r["batch"] for r in ours["decode"]} | {r["batch"] for r in hf["decode"]}):
        o = next((r for r in ours["decode"] if r["batch"] == b), {})
        h = next((r for r in hf["decode"] if r["batch"] == b), {})
        ratio = o["tokens_per_s"] / h["tokens_per_s"] if o and h else None
        print(f"B={b:<6} {fmt(o.get('tokens_per_s'), ',.1f'):>11} {fmt(o.get('copy_bandwidth_ratio'), '.2%'):>7} "
              f"{fmt(o.get('copy_bandwidth_ratio_active'), '.2%'):>7} "
              f"{fmt(o.get('copy_bandwidth_ratio_active_after', o.get('copy_bandwidth_ratio_after')), '.2%'):>7} "
              f"{fmt(h.get('tokens_per_s'), ',.1f'):>10} "
              f"{fmt(h.get('copy_bandwidth_ratio'), '.2%'):>7} {fmt(ratio, '.2f'):>8}")
    print(f"\n{'prefill':<8} {'ours tok/s':>11} {'TTFT ms':>9} {'of peak':>8} {'HF tok/s':>10} {'TTFT ms':>9} "
          f"{'of peak':>8} {'ours/HF':>8}")
    for n in sorted({r["tokens"] for r in ours["prefill"]} | {r["tokens"] for r in hf["prefill"]}):
        o = next((r for r in ours["prefill"] if r["tokens"] == n), {})
        h = next((r for r in hf["prefill"] if r["tokens"] == n), {})
        ratio = o["tokens_per_s"] / h["tokens_per_s"] if o and h else None
        print(f"{n:<8} {fmt(o.get('tokens_per_s'), ',.0f'):>11} {fmt(o.get('ttft_ms'), ',.1f'):>9} "
              f"{fmt(o.get('matmul_peak_ratio'), '.2%'):>8} {fmt(h.get('tokens_per_s'), ',.0f'):>10} "
              f"{fmt(h.get('ttft_ms'), ',.1f'):>9} {fmt(h.get('matmul_peak_ratio'), '.2%'):>8} {fmt(ratio, '.2f'):>8}")
    if s["ours"] and "error" in s["ours"]:
        print(f"ninfer bench: {s['ours']['error']}")
    for e in (s["hf"] or {}).get("errors", []):
        print(f"transformers: {e}")


# -- main ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hf_path == "torch":
        # Never import fla / causal_conv1d on this run: transformers then binds its torch functions.
        sys.modules.setdefault("fla", None)
        sys.modules.setdefault("causal_conv1d", None)
    import torch
    import transformers

    device = torch.device(args.hf_device or args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)   # Triton kernels (fla's) launch on the current device, not their tensors'
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    args.out.mkdir(parents=True, exist_ok=True)
    geometry = geometry_for(args)
    log(f"shape {args.shape}{' (tiny)' if args.tiny else ''}: {geometry['num_hidden_layers']} layers, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, device "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    work = args.work or Path(tempfile.mkdtemp(prefix="ninfer_shapes_"))
    work.mkdir(parents=True, exist_ok=True)
    folder = work / "src"
    folder.mkdir(exist_ok=True)
    family = FAMILY[args.shape].lower().replace("-", "").replace(".", "_")
    artifact = work / f"{family}-{args.shape}-{geometry['num_hidden_layers']}l.ninfer"
    name = f"{family}-{args.shape}-shape-{geometry['num_hidden_layers']}l{'-tiny' if args.tiny else ''}"
    ours = hf = conversion = None
    summary_path = args.out / f"shapes_{args.shape}.json"
    try:
        with Phase("build", sync=sync):
            model = build_hf(geometry, device, args.seed)
        weights = weight_stats(model, geometry)
        log(f"model: {weights['parameters'] / 1e9:.3f} B parameters, {weights['bytes'] / 1e9:.2f} GB")
        write_frontend(folder, args.tokenizer)
        with Phase("convert"):
            try:
                conversion = (convert_in_memory if args.convert == "memory" else convert_on_disk)(
                    model, folder, artifact, name)
            except Exception as exc:  # noqa: BLE001 - the disk route is the documented one
                if args.convert != "memory":
                    raise
                log(f"in-memory conversion failed ({type(exc).__name__}: {exc}); falling back to disk")
                traceback.print_exc()
                conversion = convert_on_disk(model, folder, artifact, name)
                conversion["memory_route_error"] = f"{type(exc).__name__}: {exc}"
        size = sum(Path(p).stat().st_size for p in conversion["paths"])
        log(f"artifact {artifact.name}: {size / 1e9:.2f} GB on disk ({conversion['route']} route)")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.no_ours:
            with Phase("ninfer bench"):
                ours = run_ours(artifact, args)
        if not args.no_hf:
            hf = run_hf(model, device, args, geometry["vocab_size"])
    finally:
        s = summarize(args, geometry, locals().get("weights") or {}, conversion, ours, hf) \
            if locals().get("weights") else None
        if s is not None:
            summary_path.write_text(json.dumps(s, indent=2, default=str))
        if not args.keep_artifact:
            shutil.rmtree(work, ignore_errors=True) if args.work is None else \
                [Path(p).unlink(missing_ok=True) for p in (conversion or {}).get("paths", [])]
    print_table(s)
    log(f"summary: {summary_path}")
    failed = (ours is not None and "error" in ours) or (hf is not None and not hf["prefill"] and not hf["decode"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
