"""Accuracy of quantized artifacts against the unquantized one on the default model's held-out texts.

Usage: ``python tools/quant_accuracy.py WORKDIR [--presets fp8,q8,...] [--texts N] [--context 512]``.
Converts the bundled default model (``ninfer_qwen3_5/default_model/qwen3_5-stdlib``) once as stored (bf16)
and once per preset into WORKDIR, builds the held-out source texts (the modules in
``tools/default_model_corpus.HELDOUT_MODULES``, as docs/default-model.md describes), and for each artifact
reports the perplexity ``Engine.score`` gives (non-overlapping windows of ``--context`` tokens, CPU, fp32
activations) and the mean KL(bf16 || quantized) of the next-token distributions over the same targets.

The KL needs full distributions, which ``score`` reduces away: this tool wraps the reference
``token_logprobs`` op (CPU) to see each chunk's logits. It is a measurement script, not engine code.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import default_model_corpus as corpus  # noqa: E402
import ninfer.ops.reference.logprobs as ref_logprobs  # noqa: E402
from ninfer.ops.registry import OpImpl  # noqa: E402

_CAPTURED: list[torch.Tensor] = []


def _capturing(logits: torch.Tensor, targets: torch.Tensor):
    _CAPTURED.append(torch.log_softmax(logits.double(), dim=-1))
    return _ORIGINAL(logits, targets)


_ORIGINAL = ref_logprobs.token_logprobs
ref_logprobs.OPS[:] = [OpImpl(op=i.op, name=i.name, fn=_capturing, devices=i.devices, dtypes=i.dtypes,
                              priority=i.priority) if i.op == "token_logprobs" else i for i in ref_logprobs.OPS]


def heldout_texts(limit: int | None) -> list[str]:
    files = corpus.list_files()
    docs = [d for d in corpus.build_documents(files) if d.heldout and d.kind == "source"]
    return [d.text for d in docs[:limit]]


def score_text(engine, text: str, context: int) -> tuple[float, int, torch.Tensor]:
    """(nll, scored tokens, fp32 log-probabilities of every scored position) of one text."""
    _CAPTURED.clear()
    rep = engine.score([text], context=context, stride=context)
    return rep.overall.nll, rep.overall.scored_tokens, torch.cat(_CAPTURED).float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--presets", default="fp8,q8,q6,q6+search,q5,q4,q4+search,mixed,nvfp4")
    p.add_argument("--texts", type=int, default=None)
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args(argv)
    import ninfer_qwen3_5
    from ninfer import Engine
    from ninfer.conversion import convert

    src = Path(ninfer_qwen3_5.__file__).parent / "default_model" / "qwen3_5-stdlib"
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    texts = heldout_texts(args.texts)
    names = ["bf16", *args.presets.split(",")]
    engines, sizes = {}, {}
    for name in names:
        out = work / f"{name}.ninfer"
        if not out.exists():
            convert(src, out, progress=False, quantize=None if name == "bf16" else name)
        sizes[name] = sum(f.stat().st_size for f in work.glob(f"{name}.ninfer*"))
        engines[name] = Engine.start(out, device="cpu", dtype="float32", purpose="causal_scoring",
                                     max_context=args.context)
    nll = dict.fromkeys(names, 0.0)
    kl = dict.fromkeys(names, 0.0)
    count = 0
    for text in texts:
        base = None
        for name in names:
            total, n, lp = score_text(engines[name], text, args.context)
            nll[name] += total
            if base is None:
                base, count = lp, count + n
            else:
                kl[name] += float((base.double().exp() * (base.double() - lp.double())).sum())
        print(f"after {count} targets: " + ", ".join(
            f"{n} ppl {math.exp(nll[n] / count):.3f} kl {kl[n] / count:.5f}" for n in names), flush=True)
    for e in engines.values():
        e.close()
    print(f"held-out source texts: {len(texts)}, scored tokens: {count}, windows of {args.context}")
    print("| artifact | bytes | perplexity | mean KL(bf16 || q) nats/token |")
    print("|---|---|---|---|")
    for name in names:
        ppl = float(torch.exp(torch.tensor(nll[name] / count, dtype=torch.float64)))
        print(f"| {name} | {sizes[name]:,} | {ppl:.3f} | {kl[name] / count:.5f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
