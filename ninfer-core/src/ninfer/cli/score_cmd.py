"""``ninfer score``: offline perplexity and per-token log-probabilities of texts (causal scoring).

Input files: ``.txt`` is one text (the whole file); ``.jsonl`` is one JSON object per line with a
``"text"`` string and an optional ``"id"`` (blank lines are skipped). Both must be UTF-8; a bad byte
is an error naming the file, the line and the offset (scoring never guesses an encoding or silently
replaces characters). The JSON report goes to ``--output``; a one-line summary goes to stdout and the
progress bar (over target tokens) to stderr. The engine is started with purpose ``causal_scoring``
and ``max_context = --context``; see docs/scoring.md for the window semantics.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ninfer.cli import checks, common
from ninfer.cli.command import CliCommand
from ninfer.errors import NInferError

DEFAULT_CONTEXT = 4096


class ScoreInputFileError(NInferError):
    """The --input file cannot be read as scoring input (the message names file, line and problem)."""


def add_arguments(p) -> None:
    common.add_model_arg(p)
    p.add_argument("--input", required=True, type=Path, metavar="FILE",
                   help=".txt (one text: the whole file) or .jsonl (one {\"text\": ..., \"id\": ...} per line)")
    p.add_argument("--output", required=True, type=Path, metavar="REPORT.json", help="where the JSON report goes")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help=f"input tokens per window (default: {DEFAULT_CONTEXT}, capped at the model's positions)")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="scored tokens per later window, 1..context (default: context // 2)")
    p.add_argument("--logprobs", action="store_true", help="record every scored token's log-probability")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                   help="with --logprobs, also the K most likely tokens at each position")
    g = p.add_argument_group("engine")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="activation dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--prefill-chunk-size", type=int, default=None, metavar="N",
                   help="tokens per model call (bounds the [N, vocab] logits held at once)")
    g.add_argument("--quiet", action="store_true", help="no progress display and no summary")


def _decode(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"line {line}, " if line is not None else ""
        raise ScoreInputFileError(f"{path}: {where}byte offset {exc.start}: not valid UTF-8 "
                                  f"({exc.reason}, byte 0x{raw[exc.start]:02x})") from None


def read_inputs(path: Path) -> list:
    """The texts of a ``.txt`` or ``.jsonl`` file as ScoreInputs (see the module docstring)."""
    from ninfer.scoring.inputs import ScoreInput

    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise ScoreInputFileError(f"{path}: --input must be a .txt or a .jsonl file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ScoreInputFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if suffix == ".txt":
        return [ScoreInput(text=_decode(raw, path), id=path.name)]
    items = []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        text = _decode(line, path, number)
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScoreInputFileError(f"{path}: line {number}: not JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise ScoreInputFileError(f"{path}: line {number}: the JSON is nested too deeply") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ScoreInputFileError(f"{path}: line {number}: expected a JSON object with a \"text\" string, "
                                      f"got {json.dumps(obj, ensure_ascii=False)[:80]}")
        try:
            obj["text"].encode("utf-8")
        except UnicodeEncodeError as exc:   # a JSON escape such as "\ud800": a character no tokenizer can encode
            raise ScoreInputFileError(f"{path}: line {number}: \"text\" has a lone UTF-16 surrogate "
                                      f"U+{ord(obj['text'][exc.start]):04X} at character {exc.start}") from None
        ident = obj.get("id")
        if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
            raise ScoreInputFileError(f"{path}: line {number}: \"id\" must be a string or an integer")
        items.append(ScoreInput(text=obj["text"], id=None if ident is None else str(ident)))
    if not items:
        raise ScoreInputFileError(f"{path}: no texts (the file has no JSON lines)")
    return items


def _check_output(path: Path) -> None:
    """The report's path before any scoring, so that a long run's results cannot be lost at the end: its folder
    exists and is writable, and the path is not a folder. (Writing may still fail later, on a full disk.)"""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ScoreInputFileError(f"cannot write the report to {path}: it is a folder")
    if not folder.is_dir():
        raise ScoreInputFileError(f"cannot write the report to {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ScoreInputFileError(f"cannot write the report to {path}: the folder {folder} is not writable")


def run(args) -> int:
    from ninfer import Engine
    from ninfer.contracts.options import EngineOptions
    from ninfer.model_source import resolve_model
    from ninfer.scoring.windows import check_window_options

    # Fail on bad options and input before loading the model.
    check_window_options(args.context if args.context is not None else DEFAULT_CONTEXT,
                         args.stride if args.stride is not None else 1)
    checks.check_engine_flags(args)
    if args.top_logprobs < 0:
        raise NInferError(f"--top-logprobs must be >= 0, got {args.top_logprobs}")
    items = read_inputs(args.input)
    _check_output(args.output)
    show = not args.quiet
    started = time.monotonic()
    artifact = resolve_model(args.model, progress=show and sys.stderr.isatty(), quiet=not show)
    kw = {k: getattr(args, k) for k in ("device", "dtype", "prefill_chunk_size") if getattr(args, k) is not None}
    # max_context sizes the KV for one window (EngineOptions needs >= 2 even for a 1-token context).
    options = EngineOptions(purpose="causal_scoring", max_context=max(2, args.context or DEFAULT_CONTEXT), **kw)
    with Engine.start(artifact, options) as engine:
        if show:
            print(f"[ninfer] loaded {engine.info.get('name', artifact.name)} for scoring in "
                  f"{time.monotonic() - started:.1f} s", file=sys.stderr)
        report = _score(engine, items, args, show)
    data = report.to_dict()
    data["input"] = {"path": str(args.input), "texts": len(items)}
    try:
        args.output.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ScoreInputFileError(f"cannot write the report to {args.output}: {exc.strerror or exc}") from exc
    if show:
        o = report.overall
        ppl = "null (no token to score)" if o.perplexity is None else f"{o.perplexity:.4f}"
        rate = report.processed_tokens / report.elapsed_s if report.elapsed_s > 0 else 0.0
        print(f"{o.texts} text{'s' if o.texts != 1 else ''}, {o.scored_tokens} scored tokens, perplexity {ppl} "
              f"(context {report.settings.context}, stride {report.settings.stride}); {rate:.0f} tok/s; "
              f"report: {args.output}")
    return 0


def _score(engine, items, args, show: bool):
    from tqdm import tqdm

    with tqdm(total=0, unit="tok", desc="scoring", disable=not show, file=sys.stderr, dynamic_ncols=True,
              mininterval=0.5) as bar:
        def progress(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        return engine.score(items, context=args.context, stride=args.stride, logprobs=args.logprobs,
                            top_logprobs=args.top_logprobs, progress=progress)


COMMAND = CliCommand(
    name="score", help="perplexity and per-token log-probabilities of texts", add_arguments=add_arguments, run=run,
    description="Score texts with the model: fixed windows of --context input tokens that advance by --stride "
                "scored tokens, every token after a text's first scored exactly once, each window from an empty "
                "state. Writes a JSON report.")
