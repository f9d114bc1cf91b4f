#!/usr/bin/env python3
"""The host-expert kernels in an engine (issue 36): a random Qwen3.5-MoE model at the 35B-A3B expert shape, stored
in bf16 and with the "mixed" recipe (experts q4), decoded with every routed expert on the host (no device cache,
no copy path) by each host kernel in turn, at each batch size.

The model: ``--layers`` layers (three GDN, one attention), hidden 2,048, ``--experts`` experts of 512 with top-8 and
a shared expert of 512, a 4,096-token vocabulary, random weights (seed 5). What it isolates is the host's share of
a decode step; the rest of the step is the small model's. Each line is ``tools/host_experts_profile.py``'s decode
rate and the host step's phases (ms a forward, summed over the MoE layers, prefills included).

    python3 tools/host_kernels_engine_ab.py --out $OUT/host-kernels-engine.txt
    python3 tools/host_kernels_engine_ab.py --device cpu --tiny --kernels torch,native   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))


def geometry(layers: int, experts: int, tiny: bool) -> dict:
    if tiny:   # the host-expert tests' widths
        return dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
                    num_hidden_layers=layers, tie_word_embeddings=False, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48, num_experts=experts, num_experts_per_tok=2)
    return dict(vocab_size=4096, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                linear_num_value_heads=32, max_position_embeddings=4096, num_hidden_layers=layers,
                tie_word_embeddings=False, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                num_experts=experts, num_experts_per_tok=8)


def build(work: Path, layers: int, experts: int, tiny: bool) -> dict[str, Path]:
    """The bf16 and "mixed" artifacts of the random model, in ``work``."""
    import torch
    from ninfer.conversion import convert
    from support.models import tiny_text_model, write_byte_tokenizer

    torch.manual_seed(0)
    model = tiny_text_model("moe", geometry(layers, experts, tiny), seed=5).bfloat16()
    model.config.architectures = ["Qwen3_5MoeForCausalLM"]
    model.save_pretrained(work / "hf", safe_serialization=True)
    write_byte_tokenizer(work / "hf")
    del model
    return {"bf16": convert(work / "hf", work / "bf16.ninfer", progress=False).paths[0],
            "mixed": convert(work / "hf", work / "mixed.ninfer", progress=False, quantize="mixed").paths[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--kernels", default="torch,native")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny widths: a CPU smoke run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from host_experts_profile import host_run
    from ninfer import Engine, EngineOptions

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, artifact in build(Path(tmp), args.layers, args.experts, args.tiny).items():
            for batch in (int(b) for b in args.batches.split(",")):
                for kernel in args.kernels.split(","):
                    opts = EngineOptions(device=args.device, max_concurrency=batch, max_context=1024,
                                         host_experts=True, expert_cache_slots=0, expert_copy_min_tokens=10**9,
                                         host_expert_kernel=kernel)
                    run = SimpleNamespace(model=artifact, batch=batch, tokens=args.tokens, seed=0)
                    rate, phases = host_run(Engine, run, opts)[:2]
                    lines.append(f"{name} B={batch} {rate} | {phases}")
                    print(lines[-1], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
