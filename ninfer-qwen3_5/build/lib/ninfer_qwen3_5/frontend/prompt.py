"""Building the owning :class:`PreparedPrompt` from rendered text, and the message normalization that
precedes rendering.

Invariants:
- Text-only prompts get MRoPE positions of three identical rows ``0..T-1`` (the T, H and W axes advance
  together over text; vision blocks will break the equality once Vision lands).
- ``thinking_open`` is True exactly when the last turn of the prompt text (after the last
  ``<|im_start|>``, or the whole text without one) opened ``<think>`` and did not close it: the model's
  output then starts as reasoning.
- Messages are rebuilt from plain JSON data before a template sees them (no foreign objects enter the
  sandbox); reasoning given as ``reasoning`` or ``thinking`` is aliased to ``reasoning_content`` (as HF
  does); tool-call ``arguments`` given as a JSON string (the OpenAI wire form) are decoded to an object,
  which is what the template renders parameter by parameter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.contracts.frontend import PreparedPrompt

from ninfer_qwen3_5.frontend.errors import ChatTemplateError
from ninfer_qwen3_5.frontend.reasoning import THINK_CLOSE, THINK_OPEN

TURN_START = "<|im_start|>"
_REASONING_ALIASES = ("reasoning_content", "thinking", "reasoning")  # HF's order


def plain_data(value: Any) -> Any:
    """A deep copy made only of dict/list/str/int/float/bool/None (tuples become lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    raise ChatTemplateError(f"chat input contains a {type(value).__name__}, only JSON data is accepted")


def _normalize_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", call)
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
        except ValueError as exc:
            raise ChatTemplateError(f"tool call {function.get('name')!r}: arguments are not valid JSON") from exc
        function["arguments"] = arguments
    return call


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        msg = plain_data(message)
        if not isinstance(msg, dict):
            raise ChatTemplateError("every chat message must be an object")
        reasoning = next((msg[k] for k in _REASONING_ALIASES if msg.get(k) is not None), None)
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_normalize_tool_call(c) if isinstance(c, dict) else c for c in msg["tool_calls"]]
        out.append(msg)
    return out


def ends_inside_thinking(text: str) -> bool:
    last_turn = text[max(text.rfind(TURN_START), 0):]
    return last_turn.rfind(THINK_OPEN) > last_turn.rfind(THINK_CLOSE)


def text_positions(length: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    row = tuple(range(length))
    return (row, row, row)


def chat_cache_points(ids: Sequence[int], turn_start_id: int | None) -> tuple[int, ...]:
    """Context-cache points of a rendered chat prompt: the offsets of its second and last ``<|im_start|>``.

    The second is where the first message (typically the system prompt) ends: conversations that share
    only that message share this prefix. The last is where the generation prompt (or the last message)
    begins: the next turn re-renders what follows it (reasoning stripped, an empty think block dropped),
    so its history agrees with this one exactly up to there. Two points per prompt keep the number of
    checkpoints (a whole StateImage each) small."""
    if turn_start_id is None:
        return ()
    starts = [i for i, t in enumerate(ids) if t == turn_start_id]
    return tuple(sorted({p for p in (starts[1:2] + starts[-1:]) if 1 <= p < len(ids)}))


def prepared_text_prompt(token_ids: Sequence[int], text: str, cache_points: tuple[int, ...] = ()) -> PreparedPrompt:
    ids = tuple(int(i) for i in token_ids)
    return PreparedPrompt(token_ids=ids, positions=text_positions(len(ids)),
                          thinking_open=ends_inside_thinking(text), cache_points=cache_points)
