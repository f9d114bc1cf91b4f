#!/usr/bin/env python3
"""Train a DFlash or DFlash2 drafter for NInfer's embedded default model (docs/speculative.md, "Training the
default model's drafters").

The drafter is written as a Hugging Face folder in the z-lab format (``config.json`` with ``dflash_config``,
``model.safetensors`` in bf16), which ``ninfer-convert TARGET OUT --draft DIR`` adds to the target's artifact.
The model is tools/dflash_model.py (the engine's drafter math, differentiable); the target is the default model
through transformers (tools/dflash_target.py); the corpus is the default model's own (tools/dflash_corpus.py).

Stages:

``prepare``  the default model's ``prepare`` (tools/train_default_model.py) into ``--work``, checked against the
             target's tokenizer and training report; ``--smoke-files N`` instead encodes N small files with the
             target's tokenizer (smoke runs, tests).
``train``    trains ``--kind dflash|dflash2`` on the training stream, writes ``--out`` (the folder plus
             ``training_report.json``: hyper-parameters, seed, losses, held-out acceptance); ``--check`` then
             runs ``check``.
``eval``     the held-out figures of an existing folder (tools/dflash_eval.py).
``check``    converts the target with the folder and compares the engine's block logits with the training
             model's (tools/dflash_parity.py); CPU, fp32.

Recipe (DFlash paper / SpecForge, see docs/speculative.md): windows of ``--seq-len`` tokens of the training
stream; per window ``--anchors-per-window`` random anchors; each block ``[x_s, mask x (B - 1)]`` attends over
the target features of positions ``< s`` and (non-causally) over itself; mask slot ``j`` is trained with
cross-entropy against ``x_{s+j}`` (``--labels target``: the target's greedy token instead), weighted
``exp(-(j - 1) / gamma)``; DFlash2 adds its convs (trained by the same loss) and the selector (cross-entropy of
its candidate scores, the label among the top-k candidates, on detached drafter outputs).

Typical use::

    python3 tools/train_dflash.py prepare --work .default_model_work
    python3 tools/train_dflash.py train --kind dflash --work .default_model_work --device cuda --out OUT/dflash
    python3 tools/train_dflash.py train --kind dflash2 --work .default_model_work --device cuda --out OUT/dflash2
    python3 tools/train_dflash.py check --work .default_model_work --out OUT/dflash
    # CPU smoke (a minute):
    python3 tools/train_dflash.py prepare --work /tmp/dw --smoke-files 4
    python3 tools/train_dflash.py train --kind dflash2 --work /tmp/dw --out /tmp/d2 --device cpu --max-steps 30 \\
        --batch-size 4 --seq-len 128 --anchors-per-window 8 --train-windows 64 --eval-max-windows 4 --check

Determinism: all randomness comes from ``--seed`` (drafter initialisation on the CPU, window and anchor draws
from a CPU generator); ``torch.use_deterministic_algorithms(True)`` everywhere, on CUDA also a fixed cuBLAS
workspace, no TF32 and the default model's deterministic cumsum in the target's forward. ``--time-budget-s``
stops early (the report says so); a run is reproducible when it ends by ``--max-steps``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import platform
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import dflash_corpus  # noqa: E402  (imports train_default_model: sets the cuBLAS workspace before CUDA starts)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import train_default_model as tdm  # noqa: E402
from dflash_loss import HeldoutCurve, block_loss, precompute  # noqa: E402
from dflash_model import DraftModel, hf_config  # noqa: E402

DEFAULT_TARGET = REPO / "ninfer-qwen3_5/src/ninfer_qwen3_5/default_model/qwen3_5-stdlib"
DEFAULT_WORK = REPO / ".default_model_work"
#: The DFlash paper's decay for its block sizes (SpecForge's suggestion); others use B / 2.
GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}
MASK_TOKEN = "<|vision_pad|>"


def report_text(report: dict) -> str:
    """``training_report.json``'s text: indented objects, each list of numbers on one line (a loss row's per-slot
    top-1, a histogram), so the report stays readable and short."""
    text = json.dumps(report, indent=1)
    return re.sub(r"\[([\s\d.,eE+\-]*)\]", lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")
                                                                     if v.strip()) + "]", text) + "\n"


def gamma_for(args) -> float:
    return args.gamma or GAMMA.get(args.block_size, args.block_size / 2)


def build_config(args, target) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.target) / "tokenizer.json"))
    mask = tok.token_to_id(args.mask_token)
    if mask is None:
        raise SystemExit(f"--mask-token {args.mask_token!r} is not a token of the target's tokenizer")
    c = target.config
    return hf_config(generation=2 if args.kind == "dflash2" else 1, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                     num_target_layers=c.num_hidden_layers, target_layer_ids=args.target_layers,
                     mask_token_id=mask, block_size=args.block_size, layers=args.layers, heads=args.heads,
                     kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                     rope_theta=args.rope_theta, rms_norm_eps=c.rms_norm_eps, conv_kernel=args.conv_kernel,
                     conv_group=args.conv_group, selector_rank=args.selector_rank,
                     selector_top_k=args.selector_top_k)


def setup_determinism(device: torch.device) -> None:
    torch.use_deterministic_algorithms(True, warn_only=False)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(args) -> dict:
    from dflash_eval import evaluate
    from dflash_target import Target

    device = torch.device(args.device)
    setup_determinism(device)
    work, out = Path(args.work), Path(args.out)
    corpus_info = dflash_corpus.check_work(work, Path(args.target))
    streams = dflash_corpus.load_streams(work)
    target = Target(Path(args.target), device, args.target_layers, with_mtp=True)
    cfg = build_config(args, target)
    model = DraftModel(cfg, target.embed, target.lm_head, seed=args.seed).to(device)
    gamma = gamma_for(args)
    wins = dflash_corpus.windows(streams["train"], args.seq_len, args.train_windows)
    t0 = time.time()
    feats, greedy = precompute(target, wins, args.feature_batch_size, device)
    ids_all = torch.from_numpy(wins).to(device)
    if args.anchors == "assistant":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(work / "tokenizer.json"))
        mask = dflash_corpus.assistant_mask(streams["train"], tok.token_to_id("<|im_start|>"),
                                            tok.token_to_id("<|im_end|>"), tok.encode("assistant").ids[0])
        valid_all = torch.from_numpy(mask[:wins.size].reshape(wins.shape)).to(device)
    else:
        valid_all = torch.ones(wins.shape, dtype=torch.bool, device=device)
    curve_set = (HeldoutCurve(target, streams["heldout_source"], args.seq_len, args.curve_windows,
                              args.eval_anchor_stride, args.block_size, args.feature_batch_size, device)
                 if args.eval_every else None)
    t_features = time.time() - t0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.kind}: {n_params:,} parameters; {len(wins)} training windows of {args.seq_len}, target features "
          f"in {t_features:.1f}s; block {args.block_size}, gamma {gamma}", flush=True)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "codebook" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=False)
    amp = device.type == "cuda" and args.dtype == "bf16"

    def autocast():
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()

    gen = torch.Generator().manual_seed(args.seed)
    curve, step, s_log, stopped_by = [], 0, 0, "max_steps"
    t_start = t_log = time.time()
    model.train()
    for step in range(args.max_steps):
        lr = tdm.lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(0, len(wins), (args.batch_size,), generator=gen)
        anchors, keep = dflash_corpus.sample_anchors(gen, valid_all[pick.to(device)].cpu(), args.anchors_per_window,
                                                     args.block_size)
        idx = pick.to(device)
        with autocast():
            losses = block_loss(model, feats[idx], ids_all[idx], greedy[idx], anchors.to(device), keep.to(device),
                                valid_all[idx], gamma, args.labels, args.selector_weight)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        last = step == args.max_steps - 1
        over = args.time_budget_s and time.time() - t_start > args.time_budget_s
        held = curve_set is not None and (step % args.eval_every == 0 or last or over)
        if step % args.log_every == 0 or last or over or held:
            row = {"step": step, "lr": round(lr, 7), "loss": round(losses["loss"].item(), 5),
                   "ce": round(losses["ce"].item(), 5), "grad_norm": round(gnorm.item(), 4),
                   "top1": [round(x, 4) for x in losses["top1"].tolist()]}
            if "selector" in losses:
                row["selector"] = round(losses["selector"].item(), 5)
            if held:
                row.update(curve_set(model, gamma, args.labels, args.selector_weight, autocast))
            curve.append(row)
            now = time.time()
            ms = 1000 * (now - t_log) / max(1, step - s_log)
            t_log, s_log = now, step
            print(f"step {step:5d} lr {lr:.2e} loss {row['loss']:.4f} ce {row['ce']:.4f}"
                  + (f" sel {row['selector']:.4f}" if "selector" in row else "")
                  + f" top1[0] {row['top1'][0]:.3f} gnorm {row['grad_norm']:.2f} step_ms {ms:.0f}"
                  + (f" heldout ce {row['heldout_ce']:.4f} top1[0] {row['heldout_top1'][0]:.3f}"
                     if "heldout_ce" in row else ""), flush=True)
        if over:
            stopped_by = "time_budget"
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - t_start
    digest = weights_sha256(model)
    model.round_to_bf16()   # evaluate what ships
    del feats, greedy, curve_set
    evaluation = {}
    for name in () if args.skip_eval else ("heldout_source", "heldout_chat"):
        evaluation[name] = evaluate(model, target, streams[name], seq_len=args.seq_len, stride=args.eval_anchor_stride,
                                    batch=args.eval_batch_size, max_windows=args.eval_max_windows, device=device)
        print(f"eval {name}: {json.dumps(evaluation[name])}", flush=True)
    report = {
        "drafter": cfg["architectures"][0], "target": Path(args.target).name, "parameters": n_params,
        "config": cfg,
        "recipe": {"labels": args.labels, "anchors": args.anchors, "loss_decay_gamma": gamma,
                   "selector_loss_weight": args.selector_weight if args.kind == "dflash2" else None},
        "training": {"seed": args.seed, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else platform.processor() or "cpu", "precision": "bf16 autocast, fp32 master weights" if amp
                     else "fp32", "steps": step + 1, "max_steps": args.max_steps, "stopped_by": stopped_by,
                     "batch_windows": args.batch_size, "seq_len": args.seq_len,
                     "anchors_per_window": args.anchors_per_window, "training_windows": len(wins),
                     "optimizer": f"AdamW(lr={args.lr}, betas=(0.9, 0.95), wd={args.weight_decay} on matrices), "
                     f"warmup {args.warmup_steps}, cosine to {args.min_lr_ratio}x, clip {args.clip}",
                     "feature_seconds": round(t_features, 1), "train_seconds": round(train_seconds, 1),
                     "weights_sha256_fp32": digest, "torch": torch.__version__, "python": platform.python_version()},
        "losses": curve,
        "evaluation": {"note": "shipped bf16 weights; greedy acceptance against the target's own argmax "
                       "(tools/dflash_eval.py)", "eval_anchor_stride": args.eval_anchor_stride, **evaluation},
        "corpus": corpus_info,
    }
    model.save(out, {"training_report.json": report_text(report)})
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({size / 2**20:.2f} MiB of weights) in {train_seconds:.1f}s of training", flush=True)
    if args.check:
        report["parity"] = check(args, target if device.type == "cpu" else None)
        (out / "training_report.json").write_text(report_text(report))
    return report


def check(args, target=None) -> dict:
    """Engine parity of the folder ``--out`` on the CPU (tools/dflash_parity.py); ``target``: a CPU
    :class:`dflash_target.Target` already loaded."""
    import tempfile

    import dflash_parity
    from dflash_model import parse_config
    from dflash_target import Target

    setup_determinism(torch.device("cpu"))
    cfg = parse_config(json.loads((Path(args.out) / "config.json").read_text()))
    stream = dflash_corpus.load_streams(Path(args.work))["heldout_source"]
    n = min(len(stream), args.check_tokens)
    tokens = stream[:n].astype(np.int64).tolist()
    b = cfg.block_size
    anchors = sorted({max(1, n // 7), max(1, n // 2), n - b})
    if target is None or target.layer_ids != list(cfg.target_layer_ids):
        target = Target(Path(args.target), torch.device("cpu"), list(cfg.target_layer_ids))
    with tempfile.TemporaryDirectory() as tmp:
        out = dflash_parity.check(target, Path(args.out), tokens, anchors, Path(tmp) / "parity.ninfer")
    print(f"parity: {json.dumps(out)}", flush=True)
    if out["drafter_max_abs_logit_error"] > args.check_tolerance or out["engine_max_abs_logit_error"] > 10 * args.check_tolerance:
        raise SystemExit(f"parity check failed: {out}")
    return out


def evaluate_folder(args) -> dict:
    from dflash_eval import evaluate
    from dflash_target import Target

    device = torch.device(args.device)
    setup_determinism(device)
    hf = json.loads((Path(args.out) / "config.json").read_text())
    ids = hf["dflash_config"]["target_layer_ids"]
    target = Target(Path(args.target), device, ids, with_mtp=True)
    model = DraftModel.load(Path(args.out), target.embed, target.lm_head).to(device)
    streams = dflash_corpus.load_streams(Path(args.work))
    out = {name: evaluate(model, target, streams[name], seq_len=args.seq_len, stride=args.eval_anchor_stride,
                          batch=args.eval_batch_size, max_windows=args.eval_max_windows, device=device)
           for name in ("heldout_source", "heldout_chat")}
    print(json.dumps(out, indent=1))
    report_path = Path(args.out) / "training_report.json"
    if args.write_report and report_path.is_file():
        # A run trained with --skip-eval (e.g. on a GPU machine with little time) gets its figures here.
        report = json.loads(report_path.read_text())
        report["evaluation"] = {"note": "shipped bf16 weights; greedy acceptance against the target's own argmax "
                                "(tools/dflash_eval.py), by the eval stage", "device": str(device),
                                "eval_anchor_stride": args.eval_anchor_stride, **out}
        report_path.write_text(report_text(report))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["prepare", "train", "eval", "check"])
    p.add_argument("--work", default=str(DEFAULT_WORK), help="prepared corpus folder (prepare writes it)")
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="the target model folder")
    p.add_argument("--out", help="drafter folder to write (train) or read (eval, check)")
    p.add_argument("--kind", choices=["dflash", "dflash2"], default="dflash")
    p.add_argument("--smoke-files", type=int, default=0, help="prepare: N small files, the target's tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="CUDA compute (the CPU runs fp32)")
    # drafter
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--target-layers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 5, 6])
    p.add_argument("--mask-token", default=MASK_TOKEN)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--conv-kernel", type=int, default=2)
    p.add_argument("--conv-group", type=int, default=16)
    p.add_argument("--selector-rank", type=int, default=32)
    p.add_argument("--selector-top-k", type=int, default=16)
    # recipe
    p.add_argument("--gamma", type=float, default=0.0, help="loss decay; 0: 4 / 5 / 7 for blocks 8 / 10 / 16")
    p.add_argument("--labels", choices=["corpus", "target"], default="corpus")
    p.add_argument("--anchors", choices=["all", "assistant"], default="all")
    p.add_argument("--selector-weight", type=float, default=1.0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32, help="windows per step")
    p.add_argument("--anchors-per-window", type=int, default=32)
    p.add_argument("--train-windows", type=int, default=0, help="use the first N training windows (0: all)")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--time-budget-s", type=float, default=0.0, help="stop training after this long (0: none)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500, help="held-out loss every N steps (0: never)")
    p.add_argument("--curve-windows", type=int, default=32, help="held-out windows of that loss")
    # evaluation and parity
    p.add_argument("--eval-anchor-stride", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--feature-batch-size", type=int, default=32, help="windows per target forward (features)")
    p.add_argument("--skip-eval", action="store_true", help="train: no held-out evaluation")
    p.add_argument("--eval-max-windows", type=int, default=0, help="0: every held-out window")
    p.add_argument("--check", action="store_true", help="train: run the parity check after training")
    p.add_argument("--write-report", action="store_true",
                   help="eval: store the figures in the folder's training_report.json")
    p.add_argument("--check-tokens", type=int, default=160)
    p.add_argument("--check-tolerance", type=float, default=1e-4)
    args = p.parse_args(argv)
    if args.warmup_steps >= args.max_steps:
        args.warmup_steps = max(1, args.max_steps // 10)
    if args.stage != "prepare" and not args.out:
        p.error(f"{args.stage} needs --out")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.stage == "prepare":
        work, target = Path(args.work), Path(args.target)
        info = (dflash_corpus.prepare_smoke(work, target, args.smoke_files, args.seed) if args.smoke_files
                else dflash_corpus.prepare(work, target, args.seed))
        print(json.dumps(info, indent=1))
        return info
    if args.stage == "train":
        return train(args)
    if args.stage == "eval":
        return evaluate_folder(args)
    return check(args)


if __name__ == "__main__":
    main()
