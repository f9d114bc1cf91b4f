"""QwenOutputSession: one request's interpretation of model output, with preview/commit.

The output flows through four stages, each a frozen value with pure step functions:
token ids -> :mod:`detokenizer` (UTF-8-safe text) -> :mod:`stop` (stop strings, applied to reasoning
and answer alike) -> :mod:`reasoning` (channel split) -> :mod:`tool_calls` (content channel only).

Invariants:
- ``preview`` is pure: it computes the stages' next values without adopting them, so previewing the
  same tokens twice gives equal previews and an uncommitted preview changes nothing. ``commit`` adopts
  exactly the state its preview computed; only the most recent preview can be committed (identity).
- A stop token (the model's EOS ids unless ``ignore_eos``, plus ``stop_token_ids``) ends the output: it
  is accepted (it is model state) but its text is published only with ``include_stop_str``, and never a
  control token's (EOS). A stop string ends the output at the token that completed it; text after the stop
  string is never published, nor the stop string itself unless ``include_stop_str``. Tokens after a stop
  are not accepted.
- ``min_tokens``: while the output is shorter, the tokens that would end it are masked (:meth:`token_mask`),
  and stop strings end nothing; a stop string that completes in a later token ends the output, even if it
  began earlier (vLLM's rule). The count includes reasoning tokens.
- Everything published, in order, plus what ``finish`` flushes, equals the whole output's text split
  into channels (the stages only hold text back, never reorder or duplicate it). One exception: under a
  ``tools`` constraint (a forced call) the content channel holds only calls, so a call the output cut
  short (``max_tokens``, a stop string) is dropped at ``finish``: no raw ``<tool_call>`` markup is ever
  published as content, and only complete calls are published.
- Tool-call ids are ``call_<session prefix>_<n>``: deterministic within the session, so previews are
  reproducible.
- A constrained session (``matcher`` set) advances its matcher in ``preview`` provisionally and keeps
  the advance only in ``commit`` (:mod:`ninfer.constrained.matcher`); ``token_mask`` gives the engine the allowed
  tokens after the committed output. A stop token the grammar accepted ends the output with
  ``"stop"`` even under ``ignore_eos`` (the grammar reached its end); a token the grammar does not
  allow means the mask was not applied: a FrontendError (an engine failure), never invalid output.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ninfer.constrained.matcher import ConstraintMatcher
from ninfer.constrained.min_tokens import MinTokensMask
from ninfer.contracts.frontend import (
    OutputDelta,
    OutputFinal,
    OutputOptions,
    OutputPreview,
    ToolCall,
)

from ninfer_qwen3_5.frontend.detokenizer import DetokenizerState, IncrementalDetokenizer
from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.reasoning import Piece, ReasoningSplitter
from ninfer_qwen3_5.frontend.stop import StopStringMatcher
from ninfer_qwen3_5.frontend.tool_calls import ParsedToolCall, ToolCallExtractor, ToolSchemas

Event = tuple[str, str] | ToolCall  # (channel, text) or a completed call


@dataclass(frozen=True)
class _Stages:
    """The committed (or previewed) value of every stage. ``stopped``: how the output ended, if it did."""

    detok: DetokenizerState
    stop: StopStringMatcher
    reasoning: ReasoningSplitter | None
    tools: ToolCallExtractor | None
    calls: int = 0
    stopped: Literal["token", "string"] | None = None


def _merge(events: Sequence[Event]) -> tuple[OutputDelta, ...]:
    """Adjacent text of one channel becomes one delta; adjacent calls one delta; order is kept."""
    deltas: list[OutputDelta] = []
    for event in events:
        last = deltas[-1] if deltas else None
        if isinstance(event, ToolCall):
            if last is not None and last.tool_calls:
                deltas[-1] = replace(last, tool_calls=last.tool_calls + (event,))
            else:
                deltas.append(OutputDelta("content", tool_calls=(event,)))
            continue
        channel, text = event
        if not text:
            continue
        if last is not None and not last.tool_calls and last.channel == channel:
            deltas[-1] = replace(last, text=last.text + text)
        else:
            deltas.append(OutputDelta(channel, text))  # type: ignore[arg-type]
    return tuple(deltas)


class QwenOutputSession:
    """Implements ``ninfer.contracts.frontend.OutputSession``. Used by the engine worker only."""

    def __init__(self, detokenizer: IncrementalDetokenizer, options: OutputOptions,
                 eos_token_ids: Sequence[int], *, call_id_prefix: str | None = None,
                 matcher: ConstraintMatcher | None = None, special_token_ids: Iterable[int] = ()):
        self.options = options
        self._matcher = matcher
        self._special = frozenset(int(t) for t in special_token_ids)   # control tokens: no published text
        self._detok = detokenizer
        stop_ids = set(options.stop_token_ids)
        if not options.ignore_eos:
            stop_ids.update(eos_token_ids)
        self._stop_ids = frozenset(int(i) for i in stop_ids)
        # What min_tokens holds back: the stop tokens and the grammar's own end tokens (EOS even under ignore_eos).
        self._ends = self._stop_ids | frozenset(matcher.stop_token_ids if matcher is not None else ())
        self._call_prefix = call_id_prefix if call_id_prefix is not None else uuid.uuid4().hex[:16]
        self._state = _Stages(
            detok=DetokenizerState(),
            stop=StopStringMatcher(tuple(options.stop)),
            reasoning=ReasoningSplitter.start(options.thinking_open) if options.parse_reasoning else None,
            tools=ToolCallExtractor(ToolSchemas.from_tools(options.tools)) if options.parse_tool_calls else None,
        )
        self._pending: tuple[OutputPreview, _Stages] | None = None
        self._committed = 0   # output tokens committed (min_tokens counts them)
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: list[ToolCall] = []
        self._closed = False

    # -- the stages -------------------------------------------------------------------------------

    def _route(self, state: _Stages, text: str) -> tuple[_Stages, list[Event]]:
        """Send stop-checked text through the channel split and the tool-call extractor."""
        if not text:
            return state, []
        if state.reasoning is None:
            return self._route_pieces(state, (("content", text),))
        reasoning, pieces = state.reasoning.feed(text)
        return self._route_pieces(replace(state, reasoning=reasoning), pieces)

    def _route_pieces(self, state: _Stages, pieces: Sequence[Piece]) -> tuple[_Stages, list[Event]]:
        events: list[Event] = []
        for channel, text in pieces:
            if channel == "reasoning" or state.tools is None:
                events.append((channel, text))
                continue
            tools, items = state.tools.feed(text)
            state = replace(state, tools=tools)
            state, more = self._calls_to_events(state, items)
            events.extend(more)
        return state, events

    def _calls_to_events(self, state: _Stages, items: Sequence[str | ParsedToolCall]) -> tuple[_Stages, list[Event]]:
        events: list[Event] = []
        for item in items:
            if isinstance(item, ParsedToolCall):
                events.append(ToolCall(f"call_{self._call_prefix}_{state.calls}", item.name, item.arguments))
                state = replace(state, calls=state.calls + 1)
            else:
                events.append(("content", item))
        return state, events

    # -- the OutputSession protocol ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise FrontendError("output session is finished")
        if self._state.stopped is not None:
            raise FrontendError("output session already stopped; only finish() may follow")

    def token_mask(self) -> ConstraintMatcher | MinTokensMask | None:
        """The allowed-token mask provider of the next token (None: unconstrained or ended). While the output is
        shorter than ``min_tokens`` the tokens that would end it are held back on top of the grammar's mask: the
        stop tokens, and the grammar's own end tokens (the model's EOS even with ``ignore_eos``)."""
        if self._closed or self._state.stopped is not None:
            return None
        if self._matcher is not None and self._matcher.terminated:
            return None   # the grammar has ended: the output ends with it
        if self._committed < self.options.min_tokens and self._ends:
            return MinTokensMask(self._matcher, sorted(self._ends), committed=self._committed,
                                 min_tokens=self.options.min_tokens)
        return self._matcher

    def _text_of(self, state: _Stages, token: int, count: int) -> tuple[_Stages, list[Event], str | None]:
        """One token's text through the detokenizer, the stop strings (which end nothing while ``count``, the
        output's length with this token, is at most ``min_tokens``, as in vLLM) and the routing; the stages after
        it, its events, and the stop string that completed in it (None if none)."""
        detok, text = self._detok.step(state.detok, token)
        state = replace(state, detok=detok)
        if not text:
            return state, [], None
        stop, fed = state.stop.feed(text, match=count > self.options.min_tokens)
        published = fed.text + (fed.stop if fed.stop is not None and self.options.include_stop_str else "")
        state, events = self._route(replace(state, stop=stop), published)
        return state, events, fed.stop

    def preview(self, tokens: Sequence[int]) -> OutputPreview:
        self._check_open()
        state, events = self._state, []
        grammar_end = rejected_at = None
        if self._matcher is not None:
            advance = self._matcher.advance(tokens)
            grammar_end = advance.accepted - 1 if advance.terminated else None
            rejected_at = advance.accepted if advance.rejected is not None else None
        accepted, finish_reason, stop_reason = len(tokens), None, None
        for i, token in enumerate(tokens):
            token = int(token)
            if i == rejected_at:  # only reached when no stop came before the token
                self._matcher.drop_provisional()
                raise FrontendError(f"token {token} breaks the request's {self.options.constraint.kind} "
                                    f"constraint: the sampler did not apply its mask")
            count = self._committed + i + 1
            if token in self._stop_ids or i == grammar_end:
                # vLLM publishes the stop token's text too; a control token (EOS) has none there.
                if self.options.include_stop_str and token not in self._special:
                    state, more, string = self._text_of(state, token, count)
                    events.extend(more)
                    if string is not None:   # a stop string completed in it: that string ended the output
                        state = replace(state, stopped="string")
                        accepted, finish_reason, stop_reason = i + 1, "stop", string
                        break
                state = replace(state, stopped="token")
                accepted, finish_reason, stop_reason = i + 1, "stop", token
                break
            state, more, string = self._text_of(state, token, count)
            events.extend(more)
            if string is not None:
                state = replace(state, stopped="string")
                accepted, finish_reason, stop_reason = i + 1, "stop", string
                break
        if self._matcher is not None:
            self._matcher.keep(accepted)
        preview = OutputPreview(accepted, finish_reason, _merge(events), stop_reason)
        self._pending = (preview, state)
        return preview

    def commit(self, preview: OutputPreview) -> None:
        self._check_open()
        if self._pending is None or self._pending[0] is not preview:
            raise FrontendError("commit() needs the most recent preview of this session")
        self._state = self._pending[1]
        self._pending = None
        self._committed += preview.accepted
        if self._matcher is not None:
            self._matcher.commit()
        self._record(preview.deltas)

    def _record(self, deltas: Sequence[OutputDelta]) -> None:
        for delta in deltas:
            (self._reasoning if delta.channel == "reasoning" else self._content).append(delta.text)
            self._tool_calls.extend(delta.tool_calls)

    def finish(self, finish_reason: str) -> OutputFinal:
        """Flush every stage (``finish_reason`` does not change what is flushed: held text is output the
        model produced) and close the session. ``OutputFinal.deltas`` holds only the flushed deltas."""
        if self._closed:
            raise FrontendError("output session is already finished")
        self._closed = True
        self._pending = None
        if self._matcher is not None:
            self._matcher.drop_provisional()
        state, events = self._state, []
        if state.stopped != "string":
            # Bytes of a character that never completed, then a stop-string prefix that never completed.
            tail = IncrementalDetokenizer.flush(state.detok)
            stop, fed = state.stop.feed(tail, match=self._committed > self.options.min_tokens)
            published = fed.text + (fed.stop if fed.stop is not None and self.options.include_stop_str else "")
            state, more = self._route(replace(state, stop=stop, detok=DetokenizerState()), published)
            events.extend(more)
            if fed.stop is None:
                state, more = self._route(state, state.stop.flush())
                events.extend(more)
        if state.reasoning is not None:
            state, more = self._route_pieces(state, state.reasoning.flush())
            events.extend(more)
        if state.tools is not None:
            forced = self.options.constraint is not None and self.options.constraint.kind == "tools"
            state, more = self._calls_to_events(state, state.tools.flush(calls_only=forced))
            events.extend(more)
        flushed = _merge(events)
        self._record(flushed)
        return OutputFinal(deltas=flushed, content="".join(self._content), reasoning="".join(self._reasoning),
                           tool_calls=tuple(self._tool_calls))
