"""``ninfer chat``: an interactive multi-turn chat REPL with streaming.

Reads one user message per line (from a terminal or piped stdin). ``/reset`` forgets the history,
``/exit`` (or end of input) leaves. Answers stream to stdout; reasoning streams to stderr. Each turn's
assistant message (content, reasoning and tool calls) goes back into the history, so the chat template
re-renders the conversation exactly as the model produced it.
"""

from __future__ import annotations

import sys

from ninfer.cli import checks, common
from ninfer.cli.command import CliCommand

HELP = "commands: /reset (forget the conversation), /exit (leave)"


def add_arguments(p) -> None:
    common.add_model_args(p)
    p.add_argument("--system", default=None, help="a system message for the conversation")
    common.add_sampling_args(p, max_tokens_default=512)


def run(args) -> int:
    from ninfer.contracts.errors import EngineClosedError, EngineFailure
    from ninfer.contracts.events import GenerationDelta, GenerationError, GenerationResult
    from ninfer.errors import NInferError

    interactive = sys.stdin.isatty()
    checks.check_sampling_flags(args)  # before the model is resolved or loaded
    with common.start_engine(args) as engine:
        # A --max-tokens no turn could fit fails now, not at the first message.
        checks.check_max_tokens_fits(args.max_tokens, max_context=engine.max_context)
        history: list[dict] = _fresh(args)
        if interactive:
            print(HELP, file=sys.stderr)
        while True:
            if interactive:
                sys.stderr.write(">>> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.startswith("/"):
                command, *extra = text.split()
                if command in ("/exit", "/reset") and extra:
                    print(f"[ninfer] {command} takes no arguments; {HELP}", file=sys.stderr)
                elif command == "/exit":
                    break
                elif command == "/reset":
                    history = _fresh(args)
                    print("[ninfer] conversation reset", file=sys.stderr)
                else:
                    print(f"[ninfer] unknown command {command!r}; {HELP}", file=sys.stderr)
                continue
            history.append({"role": "user", "content": text})
            try:
                prompt = engine.frontend.prepare_chat(history, enable_thinking=not args.no_thinking)
                budget = checks.output_budget(args.max_tokens, args.max_tokens_default,
                                              prompt_tokens=len(prompt.token_ids), max_context=engine.max_context)
                handle = engine.submit(prompt, sampling=common.sampling_params(engine, args, max_tokens=budget),
                                       output=common.output_options(args, chat=True))
            except NInferError as exc:
                if isinstance(exc, EngineFailure | EngineClosedError):
                    raise
                # This turn cannot run (too long for the context or for --max-tokens, text the tokenizer
                # refuses...): the session goes on without it.
                history.pop()
                print(f"[ninfer] error: {exc}", file=sys.stderr)
                continue
            result = None
            try:
                for event in handle:
                    if isinstance(event, GenerationDelta):
                        _stream(event.deltas)
                    elif isinstance(event, GenerationResult):
                        result = event  # its flushed text already came as the last delta
                    elif isinstance(event, GenerationError):
                        print(f"\n[ninfer] error: {event.error}", file=sys.stderr)
            except KeyboardInterrupt:
                handle.cancel()
                print("\n[ninfer] cancelled", file=sys.stderr)
            sys.stdout.write("\n")
            sys.stdout.flush()
            if result is None or result.output is None:
                history.pop()  # the turn failed: do not keep a question without an answer
                continue
            reply: dict = {"role": "assistant", "content": result.output.content}
            if result.output.reasoning:
                reply["reasoning_content"] = result.output.reasoning
            if result.output.tool_calls:
                reply["tool_calls"] = [{"type": "function", "id": c.id,
                                        "function": {"name": c.name, "arguments": dict(c.arguments)}}
                                       for c in result.output.tool_calls]
            history.append(reply)
    return 0


def _fresh(args) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def _stream(deltas) -> None:
    for d in deltas:
        out = sys.stderr if d.channel == "reasoning" else sys.stdout
        out.write(d.text)
        out.flush()


COMMAND = CliCommand(name="chat", help="interactive multi-turn chat", add_arguments=add_arguments, run=run,
                     description="An interactive multi-turn chat with streaming: one user message per line, from a "
                                 "terminal or piped stdin; /reset forgets the conversation, /exit (or end of input) "
                                 "leaves.")
