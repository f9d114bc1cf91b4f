"""``ninfer chat``: an interactive multi-turn chat REPL with streaming.

Reads one user message per entry, from a terminal (a line editor with history: :mod:`ninfer.cli.chat_input`)
or piped stdin; a block between ``\"\"\"`` lines is one multi-line message. Entries of one line starting with
``/`` are commands (:data:`HELP`). Answers stream to stdout, reasoning is set apart from them
(:mod:`ninfer.cli.render`). Each turn's assistant message (content, reasoning and tool calls) goes back into
the history, so the chat template re-renders the conversation exactly as the model produced it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ninfer.cli import chat_input, checks, common, media
from ninfer.cli.command import CliCommand
from ninfer.cli.render import TurnDisplay, stream_turn
from ninfer.errors import NInferError

HELP = ('commands: /help, /system [TEXT] (show or set the system message), /image PATH and /video PATH (attach a '
        'file to your next message), /reset (forget the conversation), /save FILE (write the conversation as JSON '
        'messages), /exit or /bye (leave, as Ctrl-D does); """ opens and closes a multi-line message; Ctrl-C clears '
        'the line or stops an answer')


def add_arguments(p) -> None:
    common.add_model_args(p)
    p.add_argument("--system", default=None, help="a system message for the conversation")
    common.add_show_thinking_arg(p)
    common.add_sampling_args(p, max_tokens_default=512)


class _Conversation:
    """The messages so far and the system message that opens them (kept by /reset)."""

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages: list[dict] = []
        self.attached: list[dict] = []   # media parts for the next user message (/image, /video)
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.attached = []

    def set_system(self, text: str) -> None:
        self.system = text
        if self.messages and self.messages[0]["role"] == "system":
            self.messages[0] = {"role": "system", "content": text}
        else:
            self.messages.insert(0, {"role": "system", "content": text})


def _command(text: str, conv: _Conversation) -> bool:
    """Run one slash command; False when the chat should end."""
    command, _, rest = text.partition(" ")
    rest = rest.strip()
    if command in ("/exit", "/bye", "/reset", "/help") and rest:
        print(f"[ninfer] {command} takes no arguments; {HELP}", file=sys.stderr)
    elif command in ("/exit", "/bye"):
        return False
    elif command == "/help":
        print(HELP, file=sys.stderr)
    elif command == "/reset":
        conv.reset()
        print("[ninfer] conversation reset", file=sys.stderr)
    elif command == "/system" and not rest:
        shown = repr(conv.system) if conv.system else "(none)"
        print(f"[ninfer] system message: {shown}", file=sys.stderr)
    elif command == "/system":
        try:
            conv.set_system(common.check_utf8(rest, "the system message"))
        except NInferError as exc:
            print(f"[ninfer] error: {exc}", file=sys.stderr)
        else:
            print("[ninfer] system message set", file=sys.stderr)
    elif command in ("/image", "/video") and not rest:
        print(f"[ninfer] {command} needs a file: {command} PATH", file=sys.stderr)
    elif command in ("/image", "/video"):
        try:
            conv.attached += media.media_parts([(command[1:], rest)])
        except NInferError as exc:
            print(f"[ninfer] error: {exc}", file=sys.stderr)
        else:
            print(f"[ninfer] {command[1:]} attached to your next message ({len(conv.attached)} attached)",
                  file=sys.stderr)
    elif command == "/save" and not rest:
        print("[ninfer] /save needs a file name: /save FILE", file=sys.stderr)
    elif command == "/save":
        path = Path(rest).expanduser()
        try:
            path.write_text(json.dumps(conv.messages, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"[ninfer] error: cannot write {path}: {exc}", file=sys.stderr)
        else:
            print(f"[ninfer] saved {len(conv.messages)} messages to {path} "
                  "(ninfer generate --messages FILE reads them)", file=sys.stderr)
    else:
        print(f"[ninfer] unknown command {command!r}; {HELP}", file=sys.stderr)
    return True


def run(args) -> int:
    from ninfer.contracts.errors import EngineClosedError, EngineFailure

    interactive = sys.stdin.isatty()
    checks.check_sampling_flags(args)  # before the model is resolved or loaded
    with common.start_engine(args) as engine:
        # A --max-tokens no turn could fit fails now, not at the first message.
        checks.check_max_tokens_fits(args.max_tokens, max_context=engine.max_context)
        conv = _Conversation(args.system)
        source = chat_input.open_source(sys.stdin, sys.stderr)
        if interactive:
            print(HELP, file=sys.stderr)
        while True:
            try:
                text = chat_input.read_message(source)
            except KeyboardInterrupt:
                if not isinstance(source, chat_input.TerminalLines):
                    sys.stderr.write("\n")  # the line editor clears its own line
                continue  # Ctrl-C at the prompt drops the line; Ctrl-D (end of input) leaves
            if text is None:
                break
            if not text.strip():
                continue
            if text.startswith("/") and "\n" not in text:
                if not _command(text, conv):
                    break
                continue
            try:
                common.check_utf8(text, "the message")
            except NInferError as exc:   # before the chat template: its position there would mean nothing
                print(f"[ninfer] error: {exc}", file=sys.stderr)
                continue
            attached, conv.attached = conv.attached, []
            conv.messages.append({"role": "user", "content": media.user_content(text, attached)})
            try:
                prompt = engine.frontend.prepare_chat(conv.messages, enable_thinking=not args.no_thinking)
                budget = checks.output_budget(args.max_tokens, args.max_tokens_default,
                                              prompt_tokens=len(prompt.token_ids), max_context=engine.max_context)
                handle = engine.submit(prompt, sampling=common.sampling_params(engine, args, max_tokens=budget),
                                       output=common.output_options(args, chat=True))
            except NInferError as exc:
                if isinstance(exc, EngineFailure | EngineClosedError):
                    raise
                # This turn cannot run (too long for the context or for --max-tokens, text the tokenizer
                # refuses...): the chat goes on without it.
                conv.messages.pop()
                # The attachments go with the turn: kept, an attachment the model refuses (no vision tower, a
                # file it cannot read) would fail every later turn too.
                dropped = f" (its {len(attached)} attachment(s) dropped: attach again to send them)" if attached \
                    else ""
                print(f"[ninfer] error: {exc}{dropped}", file=sys.stderr)
                continue
            display = TurnDisplay(sys.stdout, sys.stderr, show_thinking=args.show_thinking)
            try:
                result, error = stream_turn(handle, display, max_tokens=budget)
            except KeyboardInterrupt:
                handle.cancel()
                print("[ninfer] cancelled", file=sys.stderr)
                result, error = None, None
            if error is not None:
                print(f"[ninfer] error: {error}", file=sys.stderr)
            if result is None or result.output is None:
                conv.messages.pop()  # the turn failed: do not keep a question without an answer
                continue
            reply: dict = {"role": "assistant", "content": result.output.content}
            if result.output.reasoning:
                reply["reasoning_content"] = result.output.reasoning
            if result.output.tool_calls:
                reply["tool_calls"] = [{"type": "function", "id": c.id,
                                        "function": {"name": c.name, "arguments": dict(c.arguments)}}
                                       for c in result.output.tool_calls]
            conv.messages.append(reply)
    return 0


COMMAND = CliCommand(name="chat", help="interactive multi-turn chat", add_arguments=add_arguments, run=run,
                     description="An interactive multi-turn chat with streaming: one user message per line (a "
                                 'block between """ lines is one message), from a terminal (line editing, '
                                 "history, bracketed paste) or piped stdin. /help lists the commands: /system, "
                                 "/image PATH, /video PATH, /reset, /save FILE, /exit. Reasoning is shown dimmed on a terminal and kept off "
                                 "a redirected stdout unless --show-thinking.")
