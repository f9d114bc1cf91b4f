#!/usr/bin/env python3
"""Train NInfer's embedded default model: a small Qwen3_5ForCausalLM with one MTP layer.

The model ships in ``ninfer-qwen3_5/src/ninfer_qwen3_5/default_model/qwen3_5-stdlib/`` so that
the engine, its tests and its examples have a real (if tiny) checkpoint of the
Qwen3.5 hybrid architecture that loads offline. docs/default-model.md describes
the result; this script is the whole recipe.

Stages (``all`` runs the three in order):

``prepare``  (CPU, seconds) builds the corpus from the running interpreter's
             standard library (tools/default_model_corpus.py), trains the
             byte-level BPE tokenizer on the training split and writes the token
             streams as uint16 files plus a manifest into ``--work``. Training
             reads only these files, so the GPU machine (another Python version)
             trains on exactly the tokens built here.
``train``    trains the model and the MTP head jointly, evaluates on the
             held-out files and writes the Hugging Face folder to ``--out``.
``package``  refreshes the non-weight files of an existing model folder (chat
             template, tokenizer config, generation config) without retraining.

Typical use::

    python3 tools/train_default_model.py prepare --work .default_model_work
    python3 tools/train_default_model.py train --work .default_model_work --device cuda --out OUTDIR
    # CPU smoke check (seconds):
    python3 tools/train_default_model.py all --work /tmp/w --out /tmp/m --device cpu \\
        --smoke-files 12 --max-steps 3 --batch-size 2 --seq-len 128 --eval-max-windows 4

Determinism: every random draw comes from ``--seed`` (model init on the CPU,
batch positions from a CPU generator), so a run is reproducible on the same
software and hardware; on CUDA the script turns on
``torch.use_deterministic_algorithms(True)`` and replaces the one op in
transformers' pure-torch Gated DeltaNet path that has no deterministic CUDA
kernel (a floating-point ``cumsum``) by an equivalent fp32 matmul with a
triangular matrix (see ``deterministic_cumsum``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

# cuBLAS needs a fixed workspace layout for reproducible GEMMs; this must be
# set before CUDA is initialised, hence at import time.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import default_model_corpus as corpus  # noqa: E402

DEFAULT_WORK = REPO / ".default_model_work"
DEFAULT_OUT = REPO / "ninfer-qwen3_5/src/ninfer_qwen3_5/default_model/qwen3_5-stdlib"
CHAT_TEMPLATE = REPO / "ninfer-qwen3_5/src/ninfer_qwen3_5/frontend/templates/qwen3_5.jinja"

# Special tokens in Qwen3.5's relative order, appended after the learned BPE
# vocabulary as Qwen does. The second field says whether the token is
# "special" in the Hugging Face sense (dropped by skip_special_tokens): Qwen
# marks the reasoning and tool markers as plain added tokens, because reasoning
# and tool-call parsers must still see them in decoded text. All of them are
# atomic (never split, never produced by BPE merges).
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Qwen3.5's pre-tokenisation rule (single-digit numbers; letters include
# combining marks), so our tokenizer segments text the way the real one does.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# --------------------------------------------------------------------------- prepare


def _split_on_specials(text: str) -> list[str]:
    """Pieces of text between special-token strings, for tokenizer training only:
    the BPE trainer must not learn merges such as '<|' + 'im' from the chat markers."""
    pieces = [text]
    for tok, _ in SPECIAL_TOKENS:
        pieces = [p for piece in pieces for p in piece.split(tok)]
    return [p for p in pieces if p]


def build_tokenizer(train_texts: list[str], vocab_size: int):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        # The special tokens are appended afterwards, so the learned part
        # leaves exactly enough room for them.
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        # All 256 byte symbols, so any input encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    pieces = [p for t in train_texts for p in _split_on_specials(t)]
    tok.train_from_iterator(pieces, trainer=trainer, length=len(pieces))
    learned = tok.get_vocab_size()
    tok.add_tokens(
        [
            AddedToken(t, special=s, normalized=False, single_word=False, lstrip=False, rstrip=False)
            for t, s in SPECIAL_TOKENS
        ]
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer has {tok.get_vocab_size()} ids ({learned} learned), expected {vocab_size}; "
            "the corpus is too small for this vocabulary"
        )
    return tok


def _encode_stream(tok, texts: list[str], eot: int) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)  # every document ends with <|endoftext|>, as in Qwen pretraining
    arr = np.asarray(ids, dtype=np.int64)
    if arr.max() >= 2**16:
        raise RuntimeError("token id does not fit uint16")
    return arr.astype(np.uint16)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    lib = corpus.stdlib_dir()
    files = corpus.list_files(lib)
    if args.smoke_files:
        # A small, still deterministic slice (every k-th file, both splits) for smoke checks.
        train_f = [f for f in files if not f.heldout]
        held_f = [f for f in files if f.heldout]
        step = max(1, len(train_f) // args.smoke_files)
        files = sorted(train_f[::step][: args.smoke_files] + held_f[:2], key=lambda f: f.rel)
    docs = corpus.build_documents(files, lib, seed=args.seed)
    train_docs = [d for d in docs if not d.heldout]
    # Shuffle documents so source files, reference topics and chat examples are
    # mixed in the stream; random.Random is stable across Python versions.
    random.Random(args.seed).shuffle(train_docs)
    held_src = [d for d in docs if d.heldout and d.kind != "chat"]
    held_chat = [d for d in docs if d.heldout and d.kind == "chat"]

    t0 = time.time()
    tok = build_tokenizer([d.text for d in train_docs], args.vocab_size)
    tok.save(str(work / "tokenizer.json"))
    t_tok = time.time() - t0
    eot = tok.token_to_id("<|endoftext|>")

    streams = {
        "train": [d.text for d in train_docs],
        "heldout_source": [d.text for d in held_src],
        "heldout_chat": [d.text for d in held_chat],
    }
    stream_info = {}
    for name, texts in streams.items():
        arr = _encode_stream(tok, texts, eot)
        arr.tofile(work / f"{name}.u16")
        stream_info[name] = {
            "documents": len(texts),
            "tokens": int(arr.size),
            "utf8_bytes": sum(len(t.encode("utf-8")) for t in texts),
            "sha256": _sha256_file(work / f"{name}.u16"),
        }
    manifest = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "stdlib_dir": str(lib),
        "seed": args.seed,
        "vocab_size": args.vocab_size,
        "smoke_files": args.smoke_files,
        "heldout_modules": list(corpus.HELDOUT_MODULES),
        "document_counts": {
            k: {
                "train": sum(1 for d in docs if d.kind == k and not d.heldout),
                "heldout": sum(1 for d in docs if d.kind == k and d.heldout),
            }
            for k in ("source", "docs", "chat")
        },
        "streams": stream_info,
        "tokenizer_sha256": _sha256_file(work / "tokenizer.json"),
        "tokenizer_train_seconds": round(t_tok, 2),
        "files": [
            {
                "path": f"Lib/{f.rel}",
                "sha256": f.sha256,
                "bytes": f.size,
                "split": "heldout" if f.heldout else "train",
            }
            for f in files
        ],
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"prepare: {len(files)} files, train {stream_info['train']['tokens']} tokens "
        f"({stream_info['train']['utf8_bytes'] / max(1, stream_info['train']['tokens']):.2f} bytes/token), "
        f"held-out source {stream_info['heldout_source']['tokens']}, chat {stream_info['heldout_chat']['tokens']}; "
        f"tokenizer trained in {t_tok:.1f}s"
    )


# --------------------------------------------------------------------------- model


def make_config(vocab_size: int, eot: int, im_end: int, args):
    from transformers import Qwen3_5TextConfig

    n_layers = args.layers
    if n_layers % 4:
        raise ValueError("--layers must be a multiple of 4 (three GDN layers per full-attention layer)")
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=n_layers,
        # Qwen3.5's 3:1 hybrid layout: every fourth layer is full attention.
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        # rotary dim = 64 * 0.25 = 16, i.e. 8 frequencies; the interleaved MRoPE
        # sections split them 3/3/2 over (t, h, w) like Qwen3.5's 11/11/10 split
        # of 32. For text-only input the three axes coincide.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=eot,
        pad_token_id=eot,
        use_cache=True,
        # Keys the published Qwen3.5 configs carry and transformers passes
        # through; the engine's MTP drafter reads mtp_num_hidden_layers.
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        full_attention_interval=4,
        attn_output_gate=True,
        mamba_ssm_dtype="float32",
    )
    cfg._attn_implementation = "eager"  # plain matmul + softmax: deterministic on every device
    return cfg


def build_mtp_class():
    import torch
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    class Qwen3_5MTP(nn.Module):
        """The Qwen3.5 multi-token-prediction head (architecture notes §10).

        For position t it sees the target's final-normed hidden state h_t and the
        embedding of the next token x_{t+1}, and predicts x_{t+2} through the
        shared lm_head. Attribute names give the checkpoint names of published
        models once prefixed with ``mtp.``.
        """

        def __init__(self, config):
            super().__init__()
            h, eps = config.hidden_size, config.rms_norm_eps
            layer_cfg = copy.deepcopy(config)
            layer_cfg.num_hidden_layers = 1
            layer_cfg.layer_types = ["full_attention"]
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
            self.fc = nn.Linear(2 * h, h, bias=False)
            # transformers' own decoder layer, in its full-attention form, so the
            # MTP layer has exactly the target's attention/MLP geometry and names.
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_cfg, 0)])
            self.norm = Qwen3_5RMSNorm(h, eps=eps)
            self.reset_parameters(config.initializer_range)

        def reset_parameters(self, std: float) -> None:
            # Same convention as the main model: N(0, std) matrices, zero
            # (i.e. identity, since the norm multiplies by 1 + w) RMSNorm weights.
            for mod in self.modules():
                if isinstance(mod, nn.Linear):
                    nn.init.normal_(mod.weight, mean=0.0, std=std)
                elif isinstance(mod, Qwen3_5RMSNorm):
                    nn.init.zeros_(mod.weight)

        def forward(self, next_embeds, hidden, position_embeddings, attention_mask):
            # The embedding comes first in the concatenation, as in the checkpoints.
            u = self.fc(
                torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
            )
            out = self.layers[0](u, position_embeddings=position_embeddings, attention_mask=attention_mask)
            if isinstance(out, tuple):  # older transformers returned (hidden, ...)
                out = out[0]
            return self.norm(out)

    return Qwen3_5MTP


@contextlib.contextmanager
def deterministic_cumsum(active: bool):
    """Route floating-point CUDA cumsum through a triangular fp32 matmul.

    torch.cumsum has no deterministic CUDA kernel and raises under
    torch.use_deterministic_algorithms(True). transformers' pure-torch chunked
    Gated DeltaNet uses it once per layer, over the 64 positions of a chunk, to
    accumulate log-decays. A matmul with a lower-triangular matrix of ones
    computes the same sums with cuBLAS, which is deterministic with a fixed
    CUBLAS_WORKSPACE_CONFIG; autocast is disabled inside so the sums stay fp32
    (the log-decays feed an exp and must not be rounded to bf16).
    """
    import torch

    if not active:
        yield
        return
    orig_method, orig_fn = torch.Tensor.cumsum, torch.cumsum

    def tri_cumsum(x, dim, *, dtype=None, orig):
        if not (x.is_cuda and (x.is_floating_point() or (dtype is not None and dtype.is_floating_point))):
            return orig(x, dim, dtype=dtype)
        dim = dim % x.ndim
        n = x.shape[dim]
        work = x.to(dtype or x.dtype).float()
        tri = torch.ones(n, n, device=x.device, dtype=torch.float32).tril()
        with torch.autocast(device_type="cuda", enabled=False):
            out = torch.matmul(work.movedim(dim, -1), tri.T).movedim(-1, dim)
        return out.to(dtype or x.dtype)

    torch.Tensor.cumsum = lambda self, dim, *, dtype=None: tri_cumsum(
        self, dim, dtype=dtype, orig=orig_method
    )
    torch.cumsum = lambda input, dim, *, dtype=None, out=None: (  # noqa: A006 (torch's own argument name)
        tri_cumsum(input, dim, dtype=dtype, orig=orig_fn)
        if out is None
        else orig_fn(input, dim, dtype=dtype, out=out)
    )
    try:
        yield
    finally:
        torch.Tensor.cumsum, torch.cumsum = orig_method, orig_fn


def token_nll(logits, targets):
    """Per-token cross-entropy in fp32 (logsumexp minus the target logit).

    Written out instead of F.cross_entropy because the CUDA NLL loss kernel is
    on PyTorch's list of nondeterministic operations; gather's backward has a
    deterministic implementation."""
    import torch

    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def causal_additive_mask(n: int, device, dtype):
    import torch

    mask = torch.full((n, n), torch.finfo(dtype).min, device=device, dtype=dtype).triu(1)
    return mask[None, None]


class Trainer:
    def __init__(self, model, mtp, args, device):
        self.model, self.mtp, self.args, self.device = model, mtp, args, device
        self.amp = device.type == "cuda" and args.dtype == "bf16"

    def autocast(self):
        import torch

        if self.amp:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, ids):
        """Main next-token and MTP next-next-token outputs for a [B, T] batch.

        Returns (main_logits [B,T-1,V], mtp_logits [B,T-2,V])."""
        import torch

        model, mtp = self.model, self.mtp
        B, T = ids.shape
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # final-normed h_0..h_{T-1}
        main_logits = model.lm_head(hidden[:, :-1])
        # MTP at position t: h_t and embed(x_{t+1}) -> x_{t+2}; positions follow
        # the hidden state's position (t), as the serving engines align them.
        n = T - 2
        pos = torch.arange(n, device=ids.device)[None, None].expand(3, B, n)
        next_emb = model.model.embed_tokens(ids[:, 1 : 1 + n])
        pe = model.model.rotary_emb(next_emb, pos)
        mask = causal_additive_mask(n, ids.device, torch.float32)
        mtp_hidden = mtp(next_emb, hidden[:, :n], pe, mask)
        mtp_logits = model.lm_head(mtp_hidden)
        return main_logits, mtp_logits


def _batch_from_stream(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    idx = starts[:, None] + np.arange(seq_len)[None, :]
    return stream[idx].astype(np.int64)


def evaluate(
    trainer, stream: np.ndarray, unigram_logp, byte_len, seq_len: int, batch: int, max_windows: int | None
):
    """Held-out metrics over non-overlapping windows of the stream.

    Every window is scored independently (no carried state), so the first token
    of a window has no context and is not a target. The unigram baseline is
    scored on exactly the main head's targets."""
    import torch

    n_full = len(stream) // seq_len
    windows = [stream[i * seq_len : (i + 1) * seq_len] for i in range(n_full)]
    tail = stream[n_full * seq_len :]
    if len(tail) >= 3:
        windows.append(tail)
    if max_windows:
        windows = windows[:max_windows]
    acc = dict(
        main_nll=0.0,
        main_n=0,
        main_correct=0,
        uni_nll=0.0,
        bytes=0,
        mtp_nll=0.0,
        mtp_n=0,
        mtp_correct=0,
        agree=0,
    )
    trainer.model.eval()
    trainer.mtp.eval()
    with torch.no_grad():
        groups: list[list[np.ndarray]] = []
        for w in windows:  # batch windows of equal length together
            if groups and len(groups[-1]) < batch and len(groups[-1][0]) == len(w):
                groups[-1].append(w)
            else:
                groups.append([w])
        for g in groups:
            ids = torch.from_numpy(np.stack(g).astype(np.int64)).to(trainer.device)
            with trainer.autocast():
                main_logits, mtp_logits = trainer.forward(ids)
            tgt = ids[:, 1:]
            nll = token_nll(main_logits, tgt)
            acc["main_nll"] += nll.double().sum().item()
            acc["main_n"] += tgt.numel()
            main_pred = main_logits.argmax(-1)
            acc["main_correct"] += (main_pred == tgt).sum().item()
            acc["uni_nll"] += (-unigram_logp[tgt]).double().sum().item()
            acc["bytes"] += int(byte_len[tgt].sum().item())
            tgt2 = ids[:, 2:]
            mnll = token_nll(mtp_logits, tgt2)
            acc["mtp_nll"] += mnll.double().sum().item()
            acc["mtp_n"] += tgt2.numel()
            mtp_pred = mtp_logits.argmax(-1)
            acc["mtp_correct"] += (mtp_pred == tgt2).sum().item()
            # Greedy draft agreement: the MTP draft for x_{t+2} against what the
            # main head itself predicts at t+1 (teacher-forced), i.e. how often a
            # greedy speculative step with one MTP draft would accept it.
            acc["agree"] += (mtp_pred == main_pred[:, 1:]).sum().item()
    trainer.model.train()
    trainer.mtp.train()
    main_loss = acc["main_nll"] / acc["main_n"]
    uni_loss = acc["uni_nll"] / acc["main_n"]
    mtp_loss = acc["mtp_nll"] / acc["mtp_n"]
    return {
        "windows": len(windows),
        "targets": acc["main_n"],
        "main_loss": round(main_loss, 5),
        "main_perplexity": round(math.exp(main_loss), 3),
        "main_bits_per_byte": round(acc["main_nll"] / math.log(2) / acc["bytes"], 4),
        "main_next_token_top1": round(acc["main_correct"] / acc["main_n"], 4),
        "unigram_loss": round(uni_loss, 5),
        "unigram_perplexity": round(math.exp(uni_loss), 3),
        "unigram_bits_per_byte": round(acc["uni_nll"] / math.log(2) / acc["bytes"], 4),
        "mtp_loss": round(mtp_loss, 5),
        "mtp_perplexity": round(math.exp(mtp_loss), 3),
        "mtp_next_next_token_top1": round(acc["mtp_correct"] / acc["mtp_n"], 4),
        "mtp_greedy_agreement_with_main": round(acc["agree"] / acc["mtp_n"], 4),
    }


def weights_sha256(model, mtp) -> str:
    """Digest of all trained tensors (fp32 bytes, sorted names): equal digests
    mean bit-identical training runs."""
    h = hashlib.sha256()
    sd = {
        **{f"model.{k}": v for k, v in model.state_dict().items()},
        **{f"mtp.{k}": v for k, v in mtp.state_dict().items()},
    }
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def train(args) -> dict:
    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM

    work = Path(args.work)
    out = Path(args.out)
    manifest = json.loads((work / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    for name, info in manifest["streams"].items():
        if _sha256_file(work / f"{name}.u16") != info["sha256"]:
            raise RuntimeError(f"{name}.u16 does not match the manifest")
    train_stream = np.fromfile(work / "train.u16", dtype=np.uint16)
    held = {n: np.fromfile(work / f"{n}.u16", dtype=np.uint16) for n in ("heldout_source", "heldout_chat")}
    vocab = tok.get_vocab_size()
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")

    device = torch.device(args.device)
    deterministic_cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    # Raise on any op without a deterministic implementation rather than
    # silently producing run-to-run differences.
    torch.use_deterministic_algorithms(True, warn_only=False)
    if deterministic_cuda:
        torch.backends.cudnn.benchmark = False
        # Exact fp32 matmuls (no TF32) for the parts that run outside autocast.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    cfg = make_config(vocab, eot, im_end, args)
    # Initialise on the CPU so CPU and GPU runs start from the same weights.
    model = Qwen3_5ForCausalLM(cfg)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens")
    mtp = build_mtp_class()(cfg)
    model.to(device)
    mtp.to(device)
    model.train()
    mtp.train()
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"params: main {n_main:,} (tied embeddings), mtp {n_mtp:,}; layer_types {cfg.layer_types}")

    decay, no_decay = [], []
    for p in list(model.parameters()) + list(mtp.parameters()):
        # Matrices (and the depthwise conv) decay; norms, A_log and dt_bias do not.
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=False,
    )
    trainer = Trainer(model, mtp, args, device)

    counts = np.bincount(train_stream, minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    unigram_logp = torch.from_numpy(np.log(counts / counts.sum())).to(device)
    # UTF-8 bytes behind each id, for bits per byte: a byte-level BPE token is
    # one symbol per byte, and the added tokens are ASCII.
    byte_len = torch.tensor([len(tok.id_to_token(i)) for i in range(vocab)], device=device)

    gen = torch.Generator().manual_seed(args.seed)  # CPU generator: same batches on every device
    n_starts = len(train_stream) - args.seq_len
    curve = []
    t_start = t_log = time.time()
    s_log = 0
    tokens_seen = 0
    with deterministic_cumsum(deterministic_cuda):
        for step in range(args.max_steps):
            lr = lr_at(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            starts = torch.randint(0, n_starts, (args.batch_size,), generator=gen).numpy()
            ids = torch.from_numpy(_batch_from_stream(train_stream, starts, args.seq_len)).to(
                device, non_blocking=False
            )
            with trainer.autocast():
                main_logits, mtp_logits = trainer.forward(ids)
            main_loss = token_nll(main_logits, ids[:, 1:]).mean()
            mtp_loss = token_nll(mtp_logits, ids[:, 2:]).mean()
            loss = main_loss + args.mtp_weight * mtp_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(
                list(model.parameters()) + list(mtp.parameters()), args.clip
            )
            opt.step()
            tokens_seen += ids.numel()
            last = step == args.max_steps - 1
            if step % args.log_every == 0 or last:
                ml, tl, gn = main_loss.item(), mtp_loss.item(), gnorm.item()  # .item() synchronises
                now = time.time()
                step_ms = 1000 * (now - t_log) / max(1, step - s_log) if step else 0.0
                t_log, s_log = now, step
                print(
                    f"step {step:5d} lr {lr:.2e} loss {ml:.4f} mtp {tl:.4f} gnorm {gn:.2f} "
                    f"step_ms {step_ms:.1f} {now - t_start:.1f}s",
                    flush=True,
                )
            if args.eval_every and step > 0 and (step % args.eval_every == 0) and not last:
                r = evaluate(
                    trainer,
                    held["heldout_source"],
                    unigram_logp,
                    byte_len,
                    args.seq_len,
                    args.eval_batch_size,
                    args.curve_windows,
                )
                curve.append({"step": step, "heldout_loss": r["main_loss"], "mtp_loss": r["mtp_loss"]})
                print(f"  eval@{step}: heldout loss {r['main_loss']:.4f} mtp {r['mtp_loss']:.4f}", flush=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_seconds = time.time() - t_start
        final_train = {"main_loss": round(main_loss.item(), 5), "mtp_loss": round(mtp_loss.item(), 5)}
        digest = weights_sha256(model, mtp)
        print(f"trained {args.max_steps} steps in {train_seconds:.1f}s; weights sha256 {digest}")

        # Evaluate what ships: the bf16-rounded weights.
        with torch.no_grad():
            for p in list(model.parameters()) + list(mtp.parameters()):
                p.copy_(p.to(torch.bfloat16).float())
        results = {
            name: evaluate(
                trainer, s, unigram_logp, byte_len, args.seq_len, args.eval_batch_size, args.eval_max_windows
            )
            for name, s in held.items()
        }
    for name, r in results.items():
        print(f"eval {name}: {json.dumps(r)}")

    out.mkdir(parents=True, exist_ok=True)
    save_model_folder(model, mtp, out, work, tok)
    report = {
        "model": "qwen3_5-stdlib",
        "architecture": "Qwen3_5ForCausalLM + 1 MTP layer (mtp.*)",
        "parameters": {"main": n_main, "mtp": n_mtp, "total_unique": n_main + n_mtp},
        "training": {
            "seed": args.seed,
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
            "deterministic": "torch.use_deterministic_algorithms(True); CUDA cumsum via triangular matmul",
            "precision": "bf16 autocast, fp32 master weights" if trainer.amp else "fp32",
            "steps": args.max_steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "tokens_seen": tokens_seen,
            "epochs": round(tokens_seen / len(train_stream), 2),
            "optimizer": f"AdamW(lr={args.lr}, betas=(0.9, 0.95), wd={args.weight_decay}), warmup {args.warmup_steps}, "
            f"cosine to {args.min_lr_ratio}x, clip {args.clip}",
            "mtp_loss_weight": args.mtp_weight,
            "train_seconds": round(train_seconds, 1),
            "final_batch_losses": final_train,
            "weights_sha256_fp32": digest,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "evaluation": {
            "note": "held-out files only; non-overlapping windows of seq_len tokens; shipped bf16 weights; "
            "unigram = training-token frequencies with add-one smoothing, scored on the main head's targets",
            **results,
        },
        "heldout_curve": curve,
        "corpus": {
            "source": "CPython standard library (Lib/) of the interpreter that ran `prepare`",
            "license": "PSF License Agreement (Python Software Foundation License Version 2)",
            "python": manifest["python"],
            "streams": manifest["streams"],
            "tokenizer_sha256": manifest["tokenizer_sha256"],
            "files": manifest["files"],
        },
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    verify_folder(out, model, device)
    return report


# --------------------------------------------------------------------------- packaging


def _special_ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t, _ in SPECIAL_TOKENS}


def write_tokenizer_files(out: Path, tokenizer_json: Path, max_len: int) -> None:
    from tokenizers import Tokenizer

    if tokenizer_json.resolve() != (out / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for t, s in SPECIAL_TOKENS
    }
    cfg = {
        # Our pipeline (NFC, Qwen3.5 split regex, byte-level) is the one
        # transformers' Qwen3_5Tokenizer builds, so that class loads it faithfully.
        "tokenizer_class": "Qwen3_5Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_len,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def write_generation_config(out: Path, tok, max_len: int) -> None:
    from transformers import GenerationConfig

    ids = _special_ids(tok)
    gc = GenerationConfig(
        # Stop on both, as for the published Qwen3.5 models.
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        do_sample=True,
        temperature=0.6,
        top_k=20,
        top_p=0.95,
    )
    gc.save_pretrained(out)


def copy_chat_template(out: Path) -> bool:
    if CHAT_TEMPLATE.is_file():
        shutil.copyfile(CHAT_TEMPLATE, out / "chat_template.jinja")
        return True
    print(
        f"WARNING: {CHAT_TEMPLATE.relative_to(REPO)} does not exist yet; no chat_template.jinja written "
        "(re-run `package` once it does)"
    )
    return False


def save_model_folder(model, mtp, out: Path, work: Path, tok) -> None:
    """Write the Hugging Face folder.

    The safetensors file is written here rather than by save_pretrained so its
    tensor names and dtype do not depend on the transformers version that ran
    the training: the main model under its native Qwen3_5ForCausalLM names
    (lm_head omitted, it is tied to embed_tokens), the MTP head under mtp.*."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        tensors[k] = v.detach().to("cpu", torch.bfloat16).contiguous()
    for k, v in mtp.state_dict().items():
        tensors[f"mtp.{k}"] = v.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    cfg = copy.deepcopy(model.config)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(out)
    max_len = cfg.max_position_embeddings
    write_tokenizer_files(out, work / "tokenizer.json", max_len)
    write_generation_config(out, tok, max_len)
    copy_chat_template(out)


def verify_folder(out: Path, trained_model, device) -> None:
    """The folder must load with plain transformers (which skips mtp.*) and give
    the same logits as the trained model, rounded to bf16, on the same device."""
    import torch
    from safetensors import safe_open
    from transformers import Qwen3_5ForCausalLM

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"], cfg["architectures"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    for k in (
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.gate_proj.weight",
    ):
        assert k in keys, k
    loaded = Qwen3_5ForCausalLM.from_pretrained(
        str(out), dtype=torch.bfloat16, attn_implementation="eager"
    ).to(device)
    # Cast parameters only: buffers such as RoPE's inv_freq stay fp32, as
    # from_pretrained keeps them.
    ref = copy.deepcopy(trained_model).eval()
    for prm in ref.parameters():
        prm.data = prm.data.to(torch.bfloat16)
    ids = torch.arange(1, 65, device=device)[None] % 200
    with torch.no_grad(), deterministic_cumsum(device.type == "cuda"):
        a = loaded(input_ids=ids, use_cache=False).logits.float()
        b = ref(input_ids=ids, use_cache=False).logits.float()
    diff = (a - b).abs().max().item()
    if diff != 0.0:
        raise RuntimeError(f"reloaded checkpoint differs from the trained model (max |diff| {diff})")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"verified {out}: {len(keys)} tensors, reload bit-identical, folder {size / 2**20:.2f} MiB")


def package(args) -> None:
    from tokenizers import Tokenizer

    out = Path(args.out)
    cfg = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    write_tokenizer_files(out, out / "tokenizer.json", cfg["max_position_embeddings"])
    write_generation_config(out, tok, cfg["max_position_embeddings"])
    copy_chat_template(out)


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["prepare", "train", "package", "all"])
    p.add_argument("--work", default=str(DEFAULT_WORK), help="prepared corpus/tokenizer folder")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="model folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument(
        "--smoke-files", type=int, default=0, help="prepare: use only about N training files (smoke checks)"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="bf16", help="CUDA compute (CPU always runs fp32)"
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=800)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=80)
    p.add_argument("--curve-windows", type=int, default=32, help="held-out windows per curve point")
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--eval-max-windows", type=int, default=0, help="0 = all held-out windows")
    args = p.parse_args(argv)
    if args.warmup_steps >= args.max_steps:
        args.warmup_steps = max(1, args.max_steps // 10)
    if args.stage in ("prepare", "all"):
        prepare(args)
    if args.stage in ("train", "all"):
        train(args)
    if args.stage == "package":
        package(args)


if __name__ == "__main__":
    main()
