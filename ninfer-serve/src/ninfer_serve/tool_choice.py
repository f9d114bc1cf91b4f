"""tool_choice: which tool calls the output may hold, and forcing a call.

- ``none``: tools are still rendered into the prompt (the model knows them, as in OpenAI), but the
  output is never parsed for calls: everything is content.
- ``auto``: the request's OutputSession parses calls (``OutputOptions.parse_tool_calls``).
- ``required`` / named (Chat Completions, and Anthropic's any / tool): ``constrained`` -- the request
  carries a tools constraint (:func:`ninfer_serve.constraints.constrain`): the output is a tool call
  whose arguments satisfy the tool's schema, after the reasoning if thinking is on; the session parses
  the call as in ``auto``.
- ``required`` / named with ``constrained`` False (no route builds this any more): the call is forced by writing its start into the generation prompt: ``<tool_call>\\n<function=`` (required: the model writes the name) or
  ``<tool_call>\\n<function=NAME>\\n`` (named). The prompt's thinking block is closed first (the model
  cannot be made to think and then call without a grammar), so these modes render with
  ``enable_thinking=false``. The OutputSession is not told about the prefix; instead the session
  parses nothing and :class:`ForcedToolCalls` runs the frontend's own tool-call extractor over the
  content here, primed with the prefix. Only the call's *start* is guaranteed: the arguments are
  whatever the model writes, typed by the tool schema where they parse, and a call the model leaves
  malformed comes back as content. Argument validity is not guaranteed on this path.
- ``parallel_tool_calls: false`` (Anthropic ``disable_parallel_tool_use``) keeps only the first call
  (:class:`FirstToolCallOnly`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from ninfer.models.common.qwen.tool_calls import ParsedToolCall, ToolCallExtractor, ToolSchemas
from ninfer.runtime.contract.frontend import OutputDelta, ToolCall

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPolicy:
    mode: Mode
    name: str | None = None
    parallel: bool = True
    constrained: bool = False  # required/named enforced by a tool-call grammar, not a prompt prefix

    @property
    def forced_prefix(self) -> str:
        if self.constrained:
            return ""
        if self.mode == "required":
            return "<tool_call>\n<function="
        if self.mode == "named":
            return f"<tool_call>\n<function={self.name}>\n"
        return ""

    @property
    def session_parses_calls(self) -> bool:
        return self.mode == "auto" or self.constrained


class DeltaTransform(Protocol):
    """Rewrites a request's published deltas on the gateway side, in order; ``flush`` at the end."""

    def feed(self, deltas: Sequence[OutputDelta]) -> tuple[OutputDelta, ...]: ...

    def flush(self) -> tuple[OutputDelta, ...]: ...


class ForcedToolCalls:
    """Parses calls out of content that continues the forced prefix (see the module docstring)."""

    def __init__(self, prefix: str, tools: Sequence[Mapping[str, Any]]) -> None:
        state, items = ToolCallExtractor(ToolSchemas.from_tools(tools)).feed(prefix)
        if not state.in_call or any(items):
            raise RuntimeError(f"the forced prefix {prefix!r} must open a tool call and publish nothing")
        self._state = state
        self._ids = f"call_{uuid.uuid4().hex[:16]}"
        self._count = 0

    def _events(self, items: Sequence[str | ParsedToolCall]) -> list[OutputDelta]:
        out: list[OutputDelta] = []
        for item in items:
            if isinstance(item, ParsedToolCall):
                call = ToolCall(f"{self._ids}_{self._count}", item.name, item.arguments)
                self._count += 1
                out.append(OutputDelta("content", tool_calls=(call,)))
            elif item:
                out.append(OutputDelta("content", item))
        return out

    def feed(self, deltas: Sequence[OutputDelta]) -> tuple[OutputDelta, ...]:
        out: list[OutputDelta] = []
        for delta in deltas:
            if delta.channel != "content" or delta.tool_calls:
                out.append(delta)
                continue
            self._state, items = self._state.feed(delta.text)
            out.extend(self._events(items))
        return tuple(out)

    def flush(self) -> tuple[OutputDelta, ...]:
        return tuple(self._events(self._state.flush()))


class FirstToolCallOnly:
    """``parallel_tool_calls: false``: calls after the first are dropped."""

    def __init__(self) -> None:
        self._seen = False

    def feed(self, deltas: Sequence[OutputDelta]) -> tuple[OutputDelta, ...]:
        out: list[OutputDelta] = []
        for delta in deltas:
            if not delta.tool_calls:
                out.append(delta)
                continue
            keep = () if self._seen else delta.tool_calls[:1]
            self._seen = True
            if keep or delta.text:
                out.append(replace(delta, tool_calls=keep))
        return tuple(out)

    def flush(self) -> tuple[OutputDelta, ...]:
        return ()


def transforms_for(policy: ToolPolicy, tools: Sequence[Mapping[str, Any]]) -> tuple[DeltaTransform, ...]:
    chain: list[DeltaTransform] = []
    if policy.forced_prefix:
        chain.append(ForcedToolCalls(policy.forced_prefix, tools))
    if not policy.parallel and policy.mode != "none":
        chain.append(FirstToolCallOnly())
    return tuple(chain)
