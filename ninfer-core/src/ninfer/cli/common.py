"""Flags shared by the model-running subcommands, and building an Engine from them.

Every subcommand reaches the model through the public :class:`ninfer.Engine`; this module only turns
flags into EngineOptions / SamplingParams / OutputOptions. A plugin's command uses it too (``ninfer serve``
declares the engine flags with :func:`add_model_args` and builds its options with :func:`engine_options`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from ninfer.errors import NInferError

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")


def check_utf8(text: str, what: str) -> str:
    """``text`` (from the command line or stdin) if it is valid Unicode; else an NInferError naming ``what`` and
    its first byte that is not UTF-8. Python hands the command line and stdin over with each such byte as a lone
    surrogate (U+DC80..U+DCFF, its "surrogateescape" form), which the tokenizer would report as a UTF-16 surrogate at
    a character position in the rendered prompt, after loading the model."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        at = len(text[:exc.start].encode("utf-8", "surrogateescape"))
        if 0xDC80 <= char <= 0xDCFF:
            raise NInferError(f"{what} is not valid UTF-8: byte 0x{char - 0xDC00:02X} at byte {at}") from None
        raise NInferError(f"{what} has a lone UTF-16 surrogate U+{char:04X} at character {exc.start}") from None
    return text


def add_model_arg(p: argparse.ArgumentParser, *, metavar: str = "MODEL",
                  help: str = "a .ninfer artifact, a Hugging Face folder, a shipped default model's name "
                              "('ninfer plugins'), or a Hugging Face repo id owner/name[@revision] (from the Hugging "
                              "Face cache, else downloaded); all but an artifact are converted once into the cache; "
                              "default: the default model of the first plugin that ships one") -> None:
    """MODEL, as a positional argument or ``-m/--model`` (llama.cpp's spelling); :func:`merge_model_flag`
    folds the flag into ``args.model`` after parsing."""
    p.add_argument("model", nargs="?", default=None, metavar=metavar, help=help)
    p.add_argument("-m", "--model", dest="model_flag", default=None, metavar=metavar,
                   help="the same as the positional MODEL")


def merge_model_flag(args: argparse.Namespace) -> None:
    """``args.model`` from ``-m/--model`` when it was given; naming the model twice is an NInferError."""
    from ninfer.errors import NInferError

    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if getattr(args, "model", None) is not None:
        raise NInferError(f"the model is named twice: MODEL {args.model!r} and -m/--model {flag!r}; give one")
    args.model = flag


def add_show_thinking_arg(p: argparse.ArgumentParser) -> None:
    """``--show-thinking``: where a chat turn's reasoning goes when stdout is not a terminal
    (:class:`~ninfer.cli.render.TurnDisplay`'s ``show_thinking``)."""
    p.add_argument("--show-thinking", action="store_true",
                   help="with stdout redirected, write the reasoning to stdout too, between <think> and "
                        "</think> lines (on a terminal it is always shown, dimmed)")


def add_model_args(p: argparse.ArgumentParser, *, context_cache_default: bool = True,
                   warmup_flag: str = "warmup") -> None:
    """MODEL and the engine flags. ``context_cache_default``: whether the context cache is on unless
    ``--context-cache``/``--no-context-cache`` says otherwise (off for a benchmark, whose repeated prompts
    must be computed). ``warmup_flag``: the name of the start-up warm-up flag (``--NAME``/``--no-NAME``;
    bench says ``engine-warmup``: its ``--warmup N`` counts its excluded measurement runs)."""
    from ninfer.contracts.options import HOST_EXPERT_KERNELS

    add_model_arg(p)
    g = p.add_argument_group("engine")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="resident requests, 1..8 (default 4)")
    g.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                   help="longest prompt + output of one request (default 4096, capped by the model)")
    g.add_argument("--num-pages", type=int, default=None, metavar="PAGES",
                   help="KV pool size in pages of 16 tokens, >= what one --max-context request needs (default: "
                        "planned from device memory so every running request can reach --max-context); fewer "
                        "pages admit the same requests but preempt some under load")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="activation dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--prefill-chunk-size", type=int, default=None, metavar="TOKENS",
                   help="most prompt tokens one engine step prefills (default 8192, or smaller when the device "
                        "budget has no room for its workspace)")
    g.add_argument("--max-step-tokens", type=int, default=None, metavar="TOKENS",
                   help="most tokens one engine step computes while other requests stream (their decode rows "
                        "plus prompt chunks; default 256, 2048 with host experts): smaller keeps streams smoother "
                        "while prompts arrive, larger gives new prompts a faster first token (batch jobs)")
    g.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="also capture CUDA graphs of the steps that prefill, one per token bucket up to "
                        "--max-step-tokens, so such a step replays instead of launching its layers (default on "
                        "where decode graphs are captured; not with --speculative, vision or host experts)")
    g.add_argument("--lookahead", choices=("auto", "on", "off"), default="auto",
                   help="lookahead decode: launch the next decode step before this one's tokens reach the host "
                        "(auto: with CUDA graphs)")
    g.add_argument("--speculative", default=None, metavar="NAME",
                   help="speculative decoding backend: none (default) or one a plugin registers ('ninfer plugins' "
                        "lists them): mtp (the model's own multi-token-prediction head), dflash / dflash2 (a DFlash "
                        "block drafter added with ninfer-convert --draft); same output, fewer steps")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per step, 1..15 (default: the drafter's block size - 1 for dflash/dflash2, "
                        "3 for mtp); needs --speculative")
    g.add_argument("--vision", action=argparse.BooleanOptionalAction, default=None,
                   help="bind the model's vision tower (images and videos in prompts); --no-vision saves its memory "
                        "(default: on when the model has one)")
    g.add_argument("--vram-budget-mib", type=float, default=None, metavar="MIB",
                   help="most device memory the engine plans to use: weights, KV and state, workspace (default: "
                        "NINFER_VRAM_BUDGET_MIB, else the device's free memory)")
    g.add_argument("--host-experts", action=argparse.BooleanOptionalAction, default=None,
                   help="keep a MoE model's routed experts in host memory and compute them on the CPU (like "
                        "llama.cpp's --cpu-moe); slower, but the model needs only its other weights on the GPU "
                        "(default: only when the model does not fit the device budget)")
    g.add_argument("--device-expert-layers", type=int, default=None, metavar="N",
                   help="with host experts: keep the last N MoE layers' experts whole on the device (llama.cpp's "
                        "--n-cpu-moe counts the others; default: as many as the device budget has room for, at "
                        "least one layer staying on the host; 0: none)")
    g.add_argument("--expert-cache-slots", type=int, default=None, metavar="N",
                   help="with host experts: per host MoE layer, keep this many experts (the most routed lately) on "
                        "the device too (default: with --expert-routing-file, what the device budget has room "
                        "for after the device layers, else none; 0: none)")
    g.add_argument("--expert-copy-min-tokens", type=int, default=None, metavar="N",
                   help="with host experts: copy an uncached expert to the GPU when one layer call routes at least N "
                        "tokens to it, instead of computing it on the CPU (default: from a cost model measured at "
                        "start)")
    g.add_argument("--host-expert-threads", type=int, default=None, metavar="N",
                   help="with host experts on a GPU: the CPU threads computing them (default: one a physical core)")
    g.add_argument("--host-expert-kernel", choices=HOST_EXPERT_KERNELS, default=None,
                   help="with host experts: how the CPU computes them: 'auto' (default: 'native' on a GPU where it "
                        "builds, else 'torch'), 'torch' (two GEMMs an expert), "
                        "'compiled' (one torch.compile kernel for all of a step's experts; compiled at start) or "
                        "'native' (NInfer's C kernel: each expert read once, q4/q8 banks read as stored; built "
                        "at start with the host's C compiler)")
    g.add_argument("--expert-routing-file", default=None, metavar="FILE",
                   help="with an expert cache: start it with the experts this file counts most, and write this "
                        "run's routing into it at close (created when missing; docs/memory.md)")
    g.add_argument("--max-encode-rows", type=int, default=None, metavar="PATCHES",
                   help="most image patches one engine step encodes, and the largest frame a request may carry "
                        "(default 16384, e.g. one 2048x2048 image; the plan reserves the encoder's memory for it)")
    g.add_argument(f"--{warmup_flag}", dest="engine_warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="start-up warm-up: before the engine serves, run every kernel shape its options allow, so "
                        f"nothing compiles while serving; --no-{warmup_flag} starts faster and pays that on the first "
                        "requests (default: on with CUDA)")
    g.add_argument("--quiet", action="store_true", help="no progress display and no statistics")
    c = p.add_argument_group("context cache (docs/context-cache.md)")
    p.set_defaults(context_cache_default=context_cache_default)
    # default None: argparse would otherwise append its own "(default: True)" to the help.
    c.add_argument("--context-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="keep checkpoints of finished prefills and responses and start a request from the "
                        "longest one that is an exact prefix of its prompt; --no-context-cache turns it off "
                        f"(default: {'on' if context_cache_default else 'off'})")
    c.add_argument("--cache-host-mib", type=float, default=None, metavar="MIB",
                   help="Host tier budget for checkpoints and pause Snapshots demoted from the device, >= 0; "
                        "0 or unset: no Host tier (the default; each demotion copies on the engine thread)")
    c.add_argument("--cache-checkpoint-interval", type=int, default=None, metavar="TOKENS",
                   help="prefill distance between boundary checkpoints, a positive multiple of the page size "
                        "(16 tokens; default: the largest such multiple not above the prefill chunk size)")


def add_sampling_args(p: argparse.ArgumentParser, *, max_tokens_default: int) -> None:
    """The sampling and constrained-output flags. ``--max-tokens`` stays None unless given (an explicit value
    that does not fit the context is an error, the default is lowered to the room left: checks.output_budget);
    ``args.max_tokens_default`` holds the command's default."""
    p.set_defaults(max_tokens_default=max_tokens_default)
    g = p.add_argument_group("sampling (defaults: the model's generation_config)")
    g.add_argument("-n", "--max-tokens", type=int, default=None, metavar="N",
                   help=f"output tokens at most; prompt + N must fit --max-context (default {max_tokens_default}, "
                        "lowered to the room the prompt leaves)")
    g.add_argument("-t", "--temperature", type=float, default=None, metavar="T", help=">= 0; 0 = greedy")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus mass in (0, 1]; 1 = off")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="most likely tokens kept, >= 0; 0 = off")
    g.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="drop tokens below P times the top probability, in [0, 1]; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="X",
                   help="> 0; 1 = off (vLLM semantics)")
    g.add_argument("--presence-penalty", type=float, default=None, metavar="X", help="in [-2, 2]; 0 = off")
    g.add_argument("--frequency-penalty", type=float, default=None, metavar="X", help="in [-2, 2]; 0 = off")
    g.add_argument("--seed", type=int, default=None, metavar="N",
                   help="per-request seed in [0, 2**63): the same seed gives the same tokens (default: random)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--no-thinking", action="store_true", help="render the chat prompt with enable_thinking=false")
    c = p.add_argument_group("constrained output (at most one; a chat answer is constrained after its reasoning)")
    one = c.add_mutually_exclusive_group()
    one.add_argument("--json", action="store_true", help="the output is a JSON object")
    one.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against the JSON Schema in FILE")
    one.add_argument("--regex", metavar="PATTERN", help="the whole output matches PATTERN")
    one.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    one.add_argument("--grammar", metavar="FILE", help="the output is a sentence of the GBNF grammar in FILE (root rule)")


def engine_options(args: argparse.Namespace):
    """EngineOptions from the shared engine flags; a size, step-budget, context-cache, prefill-chunk or speculative
    flag out of range (or a cache flag given without --context-cache, --num-speculative-tokens without
    --speculative, an unregistered speculative backend) is an NInferError naming the flag, raised
    before any model is resolved or loaded."""
    from ninfer.cli.checks import check_engine_flags, speculative_options
    from ninfer.contracts.options import EngineOptions
    from ninfer.errors import NInferError

    kw: dict[str, Any] = {}
    for flag in ("max_concurrency", "max_context", "num_pages", "device", "dtype", "prefill_chunk_size",
                 "max_step_tokens", "vision", "max_encode_rows", "host_experts", "device_expert_layers",
                 "expert_cache_slots",
                 "expert_copy_min_tokens", "host_expert_threads", "host_expert_kernel", "expert_routing_file",
                 "prefill_graphs"):
        value = getattr(args, flag, None)
        if value is not None:
            kw[flag] = value
    lookahead = getattr(args, "lookahead", "auto")
    if lookahead != "auto":
        kw["lookahead"] = lookahead == "on"
    warmup = getattr(args, "engine_warmup", None)
    if warmup is not None:
        kw["warmup"] = warmup
    cache = getattr(args, "context_cache", None)
    if cache is None:
        cache = getattr(args, "context_cache_default", True)
    host_mib = getattr(args, "cache_host_mib", None)
    interval = getattr(args, "cache_checkpoint_interval", None)
    for flag, value in (("--cache-host-mib", host_mib), ("--cache-checkpoint-interval", interval)):
        if value is not None and not cache:
            raise NInferError(f"{flag} needs the context cache, which is off here (--no-context-cache, or "
                              f"a command that runs without it unless --context-cache)")
    if host_mib is not None and not (math.isfinite(host_mib) and host_mib >= 0):
        raise NInferError(f"--cache-host-mib must be a finite number >= 0 (0 turns the Host tier off), "
                          f"got {host_mib}")
    budget = getattr(args, "vram_budget_mib", None)
    if budget is not None:
        if not (math.isfinite(budget) and budget > 0):
            raise NInferError(f"--vram-budget-mib must be a finite number of MiB > 0, got {budget}")
        kw["vram_budget_mib"] = budget
    chunk = getattr(args, "prefill_chunk_size", None)
    if chunk is not None and chunk < 1:
        raise NInferError(f"--prefill-chunk-size must be at least 1 token, got {chunk}")
    page_size = EngineOptions.page_size
    if interval is not None and (interval < 1 or interval % page_size):
        raise NInferError(f"--cache-checkpoint-interval must be a positive multiple of the page size "
                          f"{page_size}, got {interval}")
    check_engine_flags(args)  # after the specific checks above, whose messages say more
    kw.update(speculative_options(args))
    kw["context_cache"] = cache
    if cache:
        if host_mib is not None:
            kw["cache_host_mib"] = host_mib
        if interval is not None:
            kw["cache_checkpoint_interval"] = interval
    return EngineOptions(**kw)


def start_engine(args: argparse.Namespace):
    """Resolve the model (converting into the cache if needed) and start an Engine, with a progress
    display on stderr unless --quiet."""
    from ninfer import Engine
    from ninfer.model_source import resolve_model

    show = not args.quiet
    options = engine_options(args)  # bad flags fail before the model is resolved or converted
    started = time.monotonic()
    # Conversion (first use of a folder) shows its own byte bar; loading shows one over weight bytes.
    artifact = resolve_model(args.model, progress=show and sys.stderr.isatty(), quiet=not show,
                             draft=options.speculative)
    bar = _LoadBar(artifact.name) if show else None
    try:
        engine = Engine.start(artifact, options, progress=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    if show:
        print(f"[ninfer] loaded {engine.info.get('name', artifact.name)} in {time.monotonic() - started:.1f} s"
              f"{startup_phases(engine.info.get('startup'))}", file=sys.stderr)
    return engine


def startup_phases(startup: dict | None) -> str:
    """`` (load 1.2 s, graphs 0.8 s, prefill graphs 0.3 s, warm-up 1.1 s)`` from ``Engine.info["startup"]``
    (empty without it; the prefill graphs' capture is part of the graphs' time)."""
    names = (("load_s", "load"), ("graphs_s", "graphs"), ("prefill_graphs_s", "prefill graphs"),
             ("warmup_s", "warm-up"))
    parts = [f"{label} {startup[key]:.1f} s" for key, label in names if startup and startup.get(key) is not None]
    return f" ({', '.join(parts)})" if parts else ""


class _LoadBar:
    """A tqdm bar over the bytes of weights read (stderr; disabled when stderr is not a terminal)."""

    def __init__(self, name: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(desc=f"loading {name}", unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                         file=sys.stderr, disable=not sys.stderr.isatty())

    def update(self, done: int, total: int) -> None:
        self._bar.total = total
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def sampling_params(engine, args: argparse.Namespace, *, max_tokens: int):
    """SamplingParams from the flags; ``max_tokens``: the budget checks.output_budget gave this request."""
    overrides: dict[str, Any] = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k, None) is not None}
    overrides["max_tokens"] = max_tokens
    if getattr(args, "ignore_eos", False):
        overrides["ignore_eos"] = True
    return engine.sampling_params(**overrides)


def output_options(args: argparse.Namespace, *, chat: bool):
    from ninfer.contracts.frontend import OutputOptions

    return OutputOptions(stop=tuple(args.stop or ()), parse_reasoning=chat, parse_tool_calls=chat,
                         constraint=output_constraint(args))


def output_constraint(args: argparse.Namespace):
    """The OutputConstraint the flags ask for (None without one); a file that cannot be read is an
    InvalidConstraintError naming it."""
    from ninfer.contracts.constraint import OutputConstraint
    from ninfer.contracts.errors import InvalidConstraintError

    def read(flag: str, path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidConstraintError(f"{flag}: cannot read {path}: {exc}") from exc

    if getattr(args, "json", False):
        return OutputConstraint.json_object()
    if getattr(args, "json_schema", None) is not None:
        return OutputConstraint.json_schema(read("--json-schema", args.json_schema))
    if getattr(args, "regex", None) is not None:
        return OutputConstraint.regex(args.regex)
    if getattr(args, "choice", None):
        return OutputConstraint.choice(args.choice)
    if getattr(args, "grammar", None) is not None:
        return OutputConstraint.gbnf(read("--grammar", args.grammar))
    return None
