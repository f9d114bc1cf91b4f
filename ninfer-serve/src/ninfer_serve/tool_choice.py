"""tool_choice: which tool calls the output may hold, and forcing a call.

- ``none``: tools are still rendered into the prompt (the model knows them, as in OpenAI), but the
  output is never parsed for calls: everything is content.
- ``auto``: the request's OutputSession parses calls (``OutputOptions.parse_tool_calls``).
- ``required`` / named (Chat Completions, and Anthropic's any / tool): the request carries a tools
  constraint (:func:`ninfer_serve.constraints.constrain`): the output is a tool call whose arguments
  satisfy the tool's schema, after the reasoning if thinking is on; the session parses the call as in
  ``auto``. The answer has no content: a complete call is a parsed ``tool_calls`` entry, and a call
  cut short (``max_tokens``) is dropped by the session, so the response has finish reason ``length``,
  no call and no raw ``<tool_call>`` markup in its content. As in OpenAI, a complete call forced by
  name finishes with ``stop``, one forced by ``required`` with ``tool_calls``.
- ``parallel_tool_calls: false`` (Anthropic ``disable_parallel_tool_use``) keeps only the first call
  (:class:`FirstToolCallOnly`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from ninfer.contracts.frontend import OutputDelta

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPolicy:
    mode: Mode
    name: str | None = None
    parallel: bool = True

    @property
    def session_parses_calls(self) -> bool:
        return self.mode != "none"

    @property
    def forces_call(self) -> bool:
        """The output is a tool call (a tools constraint): there is no content to answer with."""
        return self.mode in ("required", "named")


class DeltaTransform(Protocol):
    """Rewrites a request's published deltas on the gateway side, in order; ``flush`` at the end."""

    def feed(self, deltas: Sequence[OutputDelta]) -> tuple[OutputDelta, ...]: ...

    def flush(self) -> tuple[OutputDelta, ...]: ...


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
    if not policy.parallel and policy.mode != "none":
        chain.append(FirstToolCallOnly())
    return tuple(chain)
