"""``ninfer generate``: one completion. Content goes to stdout as it streams; statistics go to stderr.
Reasoning (``--chat`` and ``--messages``) is set apart from the answer by :mod:`ninfer.cli.render`: dimmed
on a terminal, on stderr when stdout is redirected (so ``ninfer generate ... > out.txt`` captures only the
answer), or in the file between ``<think>`` lines with ``--show-thinking``.

``--image PATH`` / ``--video PATH`` attach files to the user message (to the last one with ``--messages``) and
imply ``--chat``. The prompt is ``--prompt TEXT``, ``--prompt -`` (stdin), or stdin itself when neither ``--prompt`` nor
``--messages`` is given and stdin is not a terminal. It is used verbatim: ``\n`` in TEXT stays a backslash and
an ``n`` (a shell's ``$'...'`` quoting writes a newline), as text read from stdin keeps its final newline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ninfer.cli import checks, common, media
from ninfer.cli.command import CliCommand
from ninfer.cli.render import TurnDisplay, stream_turn
from ninfer.errors import NInferError


class InvalidMessagesError(NInferError):
    """The --messages file is not a JSON list of chat messages."""


def add_arguments(p) -> None:
    common.add_model_args(p, context_cache_default=False)  # one request per process: nothing could hit it
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", metavar="TEXT",
                     help="the prompt, verbatim (no escapes: write a newline with the shell, e.g. $'a\\nb'); "
                          "'-' reads it from stdin, as does a piped stdin without --prompt or --messages")
    src.add_argument("--messages", type=Path, metavar="FILE", help="a JSON list of {role, content} messages")
    p.add_argument("--chat", action="store_true", help="treat --prompt as a user message (chat template)")
    media.add_media_args(p)
    common.add_show_thinking_arg(p)
    common.add_sampling_args(p, max_tokens_default=128)


def prompt_text(args, stdin=None) -> str | None:
    """The --prompt text (None with --messages): verbatim, from ``stdin`` for ``-`` or, without --prompt, when
    stdin is not a terminal. No prompt at all, or an empty one from stdin, is an NInferError."""
    stdin = sys.stdin if stdin is None else stdin
    if args.messages is not None:
        return None
    if args.prompt is not None and args.prompt != "-":
        return common.check_utf8(args.prompt, "--prompt")
    if args.prompt is None and stdin.isatty():
        raise NInferError("no prompt: give --prompt TEXT, --prompt - (read stdin), --messages FILE, or pipe the "
                          "prompt into stdin")
    text = stdin.read()
    if not text:
        raise NInferError("the prompt read from stdin is empty")
    return common.check_utf8(text, "the prompt read from stdin")


def read_messages(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidMessagesError(f"cannot read messages from {path}: {exc}") from exc
    except RecursionError:
        raise InvalidMessagesError(f"cannot read messages from {path}: the JSON is nested too deeply") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not all(isinstance(m, dict) and "role" in m for m in data):
        raise InvalidMessagesError(f"{path} must hold a JSON list of messages, each with a 'role'")
    return data


def run(args) -> int:

    chat = args.messages is not None or args.chat or bool(args.media)
    checks.check_sampling_flags(args)  # like every input below: before the model is resolved or loaded
    parts = media.media_parts(args.media)
    messages = read_messages(args.messages) if args.messages is not None else None
    if messages is not None:
        messages = media.attach_to_last_user(messages, parts)
    text = prompt_text(args)
    with common.start_engine(args) as engine:
        fe = engine.frontend
        if messages is not None:
            prompt = fe.prepare_chat(messages, enable_thinking=not args.no_thinking)
        elif chat:
            prompt = fe.prepare_chat([{"role": "user", "content": media.user_content(text, parts)}],
                                     enable_thinking=not args.no_thinking)
        else:
            prompt = fe.prepare_text(text)
        budget = checks.output_budget(args.max_tokens, args.max_tokens_default, prompt_tokens=len(prompt.token_ids),
                                      max_context=engine.max_context)
        handle = engine.submit(prompt, sampling=common.sampling_params(engine, args, max_tokens=budget),
                               output=common.output_options(args, chat=chat))
        display = TurnDisplay(sys.stdout, sys.stderr, show_thinking=args.show_thinking)
        result, error = stream_turn(handle, display, max_tokens=budget)
        if error is not None:
            raise error
        if result is not None and result.output is not None:
            for call in result.output.tool_calls:
                print(json.dumps({"tool_call": call.name, "arguments": dict(call.arguments)}))
        if result is not None and not args.quiet:
            _print_stats(result)
    return 0


def _print_stats(result) -> None:
    t = result.timings
    n = result.usage.completion_tokens
    decode_s = (t.total_s - t.ttft_s) if t.ttft_s is not None else None
    rate = f"{(n - 1) / decode_s:.1f} tok/s" if decode_s and n > 1 else "n/a"
    ttft = f"{t.ttft_s * 1000:.0f} ms" if t.ttft_s is not None else "n/a"
    print(f"[ninfer] {result.usage.prompt_tokens} prompt + {n} generated tokens, finish={result.finish_reason}, "
          f"ttft {ttft}, decode {rate}", file=sys.stderr)


COMMAND = CliCommand(
    name="generate", help="generate one completion", add_arguments=add_arguments, run=run,
    description="Generate one completion. --prompt TEXT continues raw text (--prompt - or a piped stdin: read "
                "stdin); --chat renders it as one user message with the chat template; --messages FILE renders a "
                "JSON list of chat messages; --image/--video attach files to the user message (chat implied).")
