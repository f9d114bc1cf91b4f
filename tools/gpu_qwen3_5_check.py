"""Qwen3.5 numerics and decode speed at real widths: our Program (bf16) vs transformers (bf16, fp32).

For each geometry it builds a random HF model (seeded; matrices N(0, 1/fan_in), non-trivial norms,
A_log and dt_bias), rounds every weight to bf16 so the bf16 and fp32 runs share exact weight values
(differences are then compute precision only), saves it in bf16, converts it with ninfer-convert,
loads it and runs our Program. It reports, against the HF fp32 reference:

- prefill (last-token) logits: max |err| and max |err| / max |ref| of ours-bf16 and of HF-bf16;
- 32 greedy tokens: agreement of ours-bf16 and HF-bf16 with HF-fp32 (equal prefix, total equal),
  and at the first divergence the reference's top-2 logit gap (a small gap = explained by numerics);
- decode throughput of our path for the 0.8B-shaped model at B=1 and B=8: median step time over
  timed steps after warm-up (CUDA events on GPU), tokens/s = B / median.

Geometries (reference doc section 14; fewer layers than the real models):
``0.8b``: H 1024, 8 layers (6 GDN + 2 attention), 8q/2kv x 256, GDN 16/16 heads x 128, FFN 3584,
vocab 248320, tied. ``35b-a3b``: H 2048, 4 layers (3 GDN + 1 attention), 16q/2kv x 256, GDN 16/32
heads x 128, 256 experts top-8 of width 512, shared expert 512, vocab 248320, untied.

Usage (H200): ``python tools/gpu_qwen3_5_check.py`` (JSON to $OUT/gpu_qwen3_5_check.json).
Here (CPU, seconds): ``python tools/gpu_qwen3_5_check.py --device cpu --tiny``.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)            # transformers' own torch path: the same oracle everywhere
sys.modules.setdefault("causal_conv1d", None)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
            mrope_interleaved=True)
GEOMETRIES = {
    "0.8b": dict(kind="dense", vocab_size=248320, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 intermediate_size=3584, tie_word_embeddings=True, rope_parameters=ROPE,
                 max_position_embeddings=262144, rms_norm_eps=1e-6),
    "35b-a3b": dict(kind="moe", vocab_size=248320, hidden_size=2048, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, tie_word_embeddings=False, rope_parameters=ROPE,
                    max_position_embeddings=262144, rms_norm_eps=1e-6),
}
TINY = {
    "0.8b": dict(GEOMETRIES["0.8b"], vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, intermediate_size=96,
                 rope_parameters=dict(ROPE, mrope_section=[1, 1, 0])),
    "35b-a3b": dict(GEOMETRIES["35b-a3b"], vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, rope_parameters=dict(ROPE, mrope_section=[1, 1, 0])),
}


# -- model construction --------------------------------------------------------------------------
def build_hf(geometry: dict, device: torch.device, seed: int):
    """A random fp32 HF model on ``device`` whose weights are exactly bf16-representable."""
    import transformers as tf

    cfg = {k: v for k, v in geometry.items() if k != "kind"}
    with torch.device(device):
        if geometry["kind"] == "dense":
            model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**cfg))
        else:
            model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**cfg))
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape, device=device).uniform_(0.1, 2.0, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(-1.0, 1.0, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(0.5, 1.5, generator=g))
            elif p.ndim == 1:
                p.copy_(torch.empty(p.shape, device=device).uniform_(-0.5, 0.5, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=device, generator=g) / math.sqrt(p.shape[-1]))
            p.copy_(p.to(torch.bfloat16).float())
    if geometry["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


def build_program(artifact: Path, device: torch.device, dtype: torch.dtype, ops_mode: str, max_sequences: int):
    from ninfer.artifact import ArtifactReader, load_weights
    from ninfer.contracts.architecture import ProgramInit, ProgramOptions
    from ninfer.contracts.features import StartupFeatures
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    reader = ArtifactReader.open(artifact)
    config = reader.component("text").config
    registry = get_registry()
    spec = registry.architecture(config["architectures"][0])
    weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures()), device)
    ops = resolve_ops(registry.ops, device.type, dtype, force="reference" if ops_mode == "reference" else None)
    options = ProgramOptions(device=device, dtype=dtype, max_sequences=max_sequences, page_size=16,
                             num_pages=1024, max_context=4096)
    program = spec.create_program(ProgramInit(config=config, weights=weights, ops=ops, options=options))
    return program, ops


# -- driving our Program -------------------------------------------------------------------------
class Driver:
    """Reserve, run, commit every row (greedy), recording each sampled row's logits."""

    def __init__(self, program) -> None:
        from ninfer.contracts.program import RowSampling
        from ninfer.contracts.sampling import SamplingParams

        self.p = program
        self.greedy = RowSampling(SamplingParams(temperature=0.0), seed=0, step=0)
        self.last = None
        forward = program.forward

        def recording(batch):
            self.last = forward(batch)
            return self.last

        program.forward = recording

    def unit(self, decode=(), chunk=None):
        from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk

        demands = {s: 1 for s in decode}
        if chunk is not None:
            demands[chunk[0]] = chunk[1]
        if not all(self.p.reserve_units(demands).values()):
            raise RuntimeError("KV pages ran out")
        ch = () if chunk is None else (PrefillChunk(chunk[0], chunk[1], self.greedy),)
        pending = self.p.run(ExecutionUnit(decode=tuple(DecodeRow(s, self.greedy) for s in decode), chunks=ch))
        self.p.commit(pending, {r.seq: 1 for r in pending.rows})
        return {r.seq: r.tokens[0] for r in pending.rows}

    def greedy_run(self, ids: list[int], steps: int):
        seq = self.p.open_sequence(ids)
        toks = [self.unit(chunk=(seq, len(ids)))[seq]]
        first = self.last[0].float().cpu()
        for _ in range(steps - 1):
            toks.append(self.unit(decode=[seq])[seq])
        self.p.release(seq)
        return toks, first


def hf_greedy(model, ids: list[int], steps: int, device: torch.device):
    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        prefill = model(x).logits[0, -1].float().cpu()
        out = model.generate(x, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), prefill, [lg[0].float().cpu() for lg in out.logits]


def agreement(tokens: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> dict:
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), len(ref))
    out = {"equal_prefix": prefix, "equal_total": sum(a == b for a, b in zip(tokens, ref, strict=True)), "steps": len(ref)}
    if prefix < len(ref):
        top = torch.topk(ref_logits[prefix], 2).values
        out["ref_top2_gap_at_divergence"] = float(top[0] - top[1])
    return out


def logit_error(x: torch.Tensor, ref: torch.Tensor) -> dict:
    err = (x.float() - ref.float()).abs().max().item()
    return {"max_abs": err, "rel": err / max(ref.abs().max().item(), 1e-30)}


# -- measurements --------------------------------------------------------------------------------
def check_numerics(name: str, geometry: dict, device: torch.device, work: Path, args) -> dict:
    from ninfer.conversion import convert

    hf32 = build_hf(geometry, device, seed=args.seed)
    src, artifact = work / name, work / f"{name}.ninfer"
    hf16 = _bf16_copy(hf32)
    hf16.save_pretrained(src)
    convert(src, artifact, progress=False)
    shutil.rmtree(src)
    ids = torch.randint(0, geometry["vocab_size"], (args.prompt,),
                        generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
    ref_toks, ref_prefill, ref_logits = hf_greedy(hf32, ids, args.steps, device)
    del hf32
    hf_toks, hf_prefill, _ = hf_greedy(hf16, ids, args.steps, device)
    del hf16
    _empty_cache(device)
    program, ops = build_program(artifact, device, torch.bfloat16, args.ops, max_sequences=2)
    our_toks, our_prefill = Driver(program).greedy_run(ids, args.steps)
    del program
    _empty_cache(device)
    # Our path in fp32 on the same bf16-representable weights: separates structure (should match the
    # fp32 reference to fp32 noise) from bf16 rounding.
    program32, _ = build_program(artifact, device, torch.float32, args.ops, max_sequences=2)
    our32_toks, our32_prefill = Driver(program32).greedy_run(ids, args.steps)
    del program32
    result = {
        "prefill_ours_fp32": logit_error(our32_prefill, ref_prefill),
        "greedy_ours_fp32": agreement(our32_toks, ref_toks, ref_logits),
        "prefill_ours_bf16": logit_error(our_prefill, ref_prefill),
        "prefill_hf_bf16": logit_error(hf_prefill, ref_prefill),
        "greedy_ours_bf16": agreement(our_toks, ref_toks, ref_logits),
        "greedy_hf_bf16": agreement(hf_toks, ref_toks, ref_logits),
        "ref_max_abs_logit": ref_prefill.abs().max().item(),
        "ops": ops.describe(),
    }
    _empty_cache(device)
    return result


def measure_decode(artifact: Path, device: torch.device, args) -> dict:
    program, _ = build_program(artifact, device, torch.bfloat16, args.ops, max_sequences=8)
    drv = Driver(program)
    out = {}
    for batch in (1, 8):
        seqs = []
        for b in range(batch):
            ids = torch.randint(0, program.vocab_size, (32 + b,), generator=torch.Generator().manual_seed(b)).tolist()
            seqs.append(program.open_sequence(ids))
            drv.unit(chunk=(seqs[-1], len(ids)))
        for _ in range(args.warmup):
            drv.unit(decode=seqs)
        times = []
        for _ in range(args.timed):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                drv.unit(decode=seqs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                drv.unit(decode=seqs)
                times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        out[f"B={batch}"] = {"median_step_ms": median * 1e3, "tok_s": batch / median}
        for s in seqs:
            program.release(s)
    return out


def _bf16_copy(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16).eval()


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- report --------------------------------------------------------------------------------------
def print_table(report: dict) -> None:
    print(f"\nQwen3.5 check on {report['device']} (torch {report['torch']}, transformers {report['transformers']})")
    print(f"{'case':<10} {'who':<10} {'prefill max|err|':>17} {'rel':>9} {'greedy =prefix/total':>22} {'gap@div':>8}")
    for name, r in report["cases"].items():
        if "error" in r:
            print(f"{name:<10} FAILED: {r['error']}")
            continue
        for who in ("ours_fp32", "ours_bf16", "hf_bf16"):
            e, g = r[f"prefill_{who}"], r[f"greedy_{who}"]
            gap = g.get("ref_top2_gap_at_divergence")
            print(f"{name:<10} {who:<10} {e['max_abs']:>17.4e} {e['rel']:>9.2e} "
                  f"{g['equal_prefix']:>10}/{g['equal_total']}/{g['steps']:<9} "
                  f"{'-' if gap is None else f'{gap:.4f}':>8}")
    for key, v in report.get("decode", {}).items():
        print(f"decode 0.8b {key}: {v['tok_s']:.1f} tok/s (median step {v['median_step_ms']:.2f} ms)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke run of the whole script)")
    ap.add_argument("--cases", default="0.8b,35b-a3b")
    ap.add_argument("--layers-0.8b", dest="layers_dense", type=int, default=8)
    ap.add_argument("--layers-35b", dest="layers_moe", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64, help="prompt length")
    ap.add_argument("--steps", type=int, default=32, help="greedy steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timed", type=int, default=30)
    ap.add_argument("--ops", choices=("reference", "auto"), default="reference",
                    help="reference: torch reference ops only; auto: highest-priority ops (Triton on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)

    import transformers

    device = torch.device(args.device)
    geoms = TINY if args.tiny else GEOMETRIES
    layers = {"0.8b": args.layers_dense, "35b-a3b": args.layers_moe}
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "tiny": args.tiny,
              "ops_mode": args.ops, "cases": {}, "decode": {}}
    work = Path(tempfile.mkdtemp(prefix="qwen3_5_check_"))
    try:
        for name in args.cases.split(","):
            geometry = dict(geoms[name], num_hidden_layers=layers[name])
            t0 = time.perf_counter()
            try:
                report["cases"][name] = check_numerics(name, geometry, device, work, args)
            except Exception as exc:  # report and go on: one geometry failing must not hide the others
                report["cases"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            report["cases"][name]["seconds"] = time.perf_counter() - t0
            if name == "0.8b" and "error" not in report["cases"][name]:
                report["decode"] = measure_decode(work / "0.8b.ninfer", device, args)
            for f in work.glob(f"{name}.ninfer*"):  # artifacts of real widths are GBs: drop each when done
                f.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_qwen3_5_check.json").write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {out / 'gpu_qwen3_5_check.json'}")
    return 1 if any("error" in r for r in report["cases"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
