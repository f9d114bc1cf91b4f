"""A generation's published output -> Responses output items, and the stream events that build them.

:class:`OutputAssembler` is fed the generation's :class:`~ninfer_serve.generation.Step` s in order and
returns, for each, the stream events it causes (without ``sequence_number``, which the stream writer
numbers); the non-streaming route feeds it the same way and drops the events, so a response and
its stream always agree.

Items, in output order: a ``reasoning`` item while the model thinks (its text as one
``reasoning_text`` content part), a ``message`` item for the answer (one ``output_text`` part), one
``function_call`` item per parsed tool call (published whole by the output session, so its
arguments arrive as a single delta). A change of channel closes the open item and opens the next.
Event sequence per item: ``output_item.added``, ``content_part.added``, text deltas, the text's
``.done``, ``content_part.done``, ``output_item.done``; for a call ``output_item.added``,
``function_call_arguments.delta`` / ``.done``, ``output_item.done``.

``reasoning_tokens`` counts the tokens generated while the output was in the reasoning section
(a step's tokens belong to the channel of its last delta, or the current one when it published
none); the ``</think>`` token that ends it counts as reasoning.

:class:`ResponseFrame` holds what every state of one response object shares (id, creation time,
the echoed request settings); :func:`conclude` turns a finished generation into the final object
(status ``completed``, ``incomplete`` for a length or deadline finish, ``cancelled``) and its usage.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.contracts.frontend import ToolCall

from ninfer_serve.generation import Outcome, Step
from ninfer_serve.responses_models import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class OutputAssembler:
    def __init__(self, *, thinking_open: bool) -> None:
        self.items: list[OutputItem] = []
        self.reasoning_tokens = 0
        self._channel = "reasoning" if thinking_open else "content"
        self._open: str | None = None       # "reasoning" or "content": the kind of the open item
        self._open_id = ""
        self._text: list[str] = []

    # -- events -----------------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.items)

    def _begin(self, kind: str) -> list[dict[str, Any]]:
        self._open, self._open_id, self._text = kind, new_id("rs_" if kind == "reasoning" else "msg_"), []
        part: dict[str, Any]
        if kind == "reasoning":
            item: Any = ReasoningItem(id=self._open_id, status="in_progress", content=[])
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = MessageItem(id=self._open_id, status="in_progress", content=[])
            part = OutputText(text="").model_dump(mode="json")
        head = {"output_index": self._index, "item_id": self._open_id}
        return [{"type": "response.output_item.added", "output_index": self._index, "item": item.model_dump(mode="json")},
                {"type": "response.content_part.added", **head, "content_index": 0, "part": part}]

    def _delta(self, text: str) -> dict[str, Any]:
        self._text.append(text)
        head = {"output_index": self._index, "item_id": self._open_id, "content_index": 0, "delta": text}
        if self._open == "reasoning":
            return {"type": "response.reasoning_text.delta", **head}
        return {"type": "response.output_text.delta", **head, "logprobs": []}

    def _end(self, status: ItemStatus) -> list[dict[str, Any]]:
        text = "".join(self._text)
        head = {"output_index": self._index, "item_id": self._open_id, "content_index": 0}
        if self._open == "reasoning":
            part: Any = ReasoningText(text=text)
            item: OutputItem = ReasoningItem(id=self._open_id, status=status, content=[part])
            done = {"type": "response.reasoning_text.done", **head, "text": text}
        else:
            part = OutputText(text=text)
            item = MessageItem(id=self._open_id, status=status, content=[part])
            done = {"type": "response.output_text.done", **head, "text": text, "logprobs": []}
        events = [done, {"type": "response.content_part.done", **head, "part": part.model_dump(mode="json")},
                  {"type": "response.output_item.done", "output_index": self._index,
                   "item": item.model_dump(mode="json")}]
        self.items.append(item)
        self._open = None
        return events

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
        item = FunctionCallItem(id=new_id("fc_"), status="in_progress", call_id=call.id, name=call.name,
                                arguments="")
        head = {"output_index": self._index, "item_id": item.id}
        done = item.model_copy(update={"status": "completed", "arguments": arguments})
        events = [{"type": "response.output_item.added", "output_index": self._index,
                   "item": item.model_dump(mode="json")},
                  {"type": "response.function_call_arguments.delta", **head, "delta": arguments},
                  {"type": "response.function_call_arguments.done", **head, "name": call.name,
                   "arguments": arguments},
                  {"type": "response.output_item.done", "output_index": self._index,
                   "item": done.model_dump(mode="json")}]
        self.items.append(done)
        return events

    # -- feeding ----------------------------------------------------------------------------------
    def feed(self, step: Step) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in step.deltas:
            if d.tool_calls:
                if self._open is not None:
                    events += self._end("completed")
                for call in d.tool_calls:
                    events += self._call(call)
                continue
            kind = "reasoning" if d.channel == "reasoning" else "content"
            self._channel = kind
            if not d.text:
                continue
            if self._open != kind:
                if self._open is not None:
                    events += self._end("completed")
                events += self._begin(kind)
            events.append(self._delta(d.text))
        if self._channel == "reasoning":
            self.reasoning_tokens += len(step.token_ids)
        return events

    def finish(self, *, complete: bool, answer_expected: bool) -> list[dict[str, Any]]:
        """Close the open item (``incomplete`` unless the response is ``complete``). A complete response
        that said nothing but its reasoning still gets an (empty) message item when an answer could be
        text (``answer_expected``: no forced tool call), as Chat Completions answers ``content: ""``."""
        events = self._end("completed" if complete else "incomplete") if self._open is not None else []
        if complete and answer_expected and not any(isinstance(i, MessageItem | FunctionCallItem) for i in self.items):
            events += self._begin("content")
            events += self._end("completed")
        return events

    # -- views ------------------------------------------------------------------------------------
    def assistant_turn(self) -> dict[str, Any]:
        """The output as the chat template's assistant message (what a follow-up renders)."""
        text = "".join(c.text for i in self.items if isinstance(i, MessageItem) for c in i.content)
        reasoning = "".join(c.text for i in self.items if isinstance(i, ReasoningItem) for c in i.content)
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            msg["reasoning_content"] = reasoning
        calls = [{"id": i.call_id, "type": "function",
                  "function": {"name": i.name, "arguments": json.loads(i.arguments)}}
                 for i in self.items if isinstance(i, FunctionCallItem)]
        if calls:
            msg["tool_calls"] = calls
        return msg


@dataclass(frozen=True)
class ResponseFrame:
    """What every state of one response object shares: its id, creation time, model and the request
    settings it echoes back (as OpenAI's objects do)."""

    id: str
    created_at: int
    model: str
    echo: Mapping[str, Any]

    @classmethod
    def of(cls, req: ResponsesRequest, *, response_id: str, model: str) -> ResponseFrame:
        fmt = req.text.format.model_dump(mode="json", by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                              "summary": req.reasoning.summary if req.reasoning else None},
                "store": req.store, "temperature": req.temperature, "top_p": req.top_p, "text": {"format": fmt},
                "tool_choice": choice if isinstance(choice, str) else choice.model_dump(mode="json"),
                "tools": [t.model_dump(mode="json", exclude_none=True) for t in req.tools or ()],
                "user": req.user, "metadata": dict(req.metadata or {})}
        return cls(response_id, int(time.time()), model, echo)

    def object(self, status: ResponseStatus, output: list[OutputItem] | None = None, **fields: Any) -> ResponseObject:
        return ResponseObject(id=self.id, created_at=self.created_at, model=self.model, status=status,
                              output=list(output or ()), **self.echo, **fields)


def conclude(frame: ResponseFrame, assembler: OutputAssembler, outcome: Outcome, *, answer_expected: bool
             ) -> tuple[ResponseObject, list[dict[str, Any]]]:
    """The finished response object of ``outcome``, and the events that close its output."""
    status: ResponseStatus
    if outcome.finish_reason == "stop":
        status = "completed"
    elif outcome.finish_reason == "cancelled":
        status = "cancelled"
    else:  # length (max_output_tokens or the context's room), deadline
        status = "incomplete"
    events = assembler.finish(complete=status == "completed", answer_expected=answer_expected)
    usage = ResponseUsage(input_tokens=outcome.prompt_tokens, output_tokens=outcome.completion_tokens,
                          input_tokens_details=InputTokensDetails(cached_tokens=outcome.cached_tokens),
                          output_tokens_details=OutputTokensDetails(reasoning_tokens=assembler.reasoning_tokens),
                          total_tokens=outcome.prompt_tokens + outcome.completion_tokens)
    incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    return frame.object(status, assembler.items, usage=usage, incomplete_details=incomplete), events
