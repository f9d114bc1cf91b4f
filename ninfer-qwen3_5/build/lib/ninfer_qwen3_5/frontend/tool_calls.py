"""Qwen3.5 XML tool calls in the content channel, parsed into typed arguments.

The model writes (the Qwen3-Coder format)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Parsing rules (``parse_tool_call``):
- exactly one ``<function=NAME>...</function>`` inside the call, only whitespace around it;
- parameters are ``<parameter=ARG>VALUE</parameter>`` blocks separated by whitespace; one newline
  right after the opening tag and one right before the closing tag are formatting, the rest is the
  value verbatim; a value cannot contain ``</parameter>`` or another ``<parameter=`` (unrepresentable);
- anything else is malformed: the whole ``<tool_call>...</tool_call>`` text is published as content.

Typing (``convert_argument``): the parameter's JSON schema ``type`` (a name, a list of names, or
anyOf/oneOf of primitives) is tried in order: integer, number, boolean, object/array (JSON), null,
string as is. A value no listed type accepts, a parameter the schema does not list, and a tool not in
the request's tools all keep the raw string.

Streaming (``ToolCallExtractor``): content before a call is published as it comes, a call is published
only once complete; a forced call (``flush(calls_only=True)``) cut short publishes nothing. Whitespace
adjacent to a tool call is dropped (the template renders
``content\\n\\n<tool_call>...</tool_call>\\n<tool_call>...``), so trailing content whitespace is held back
until later text shows it is not followed by a call.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ninfer_qwen3_5.frontend.holdback import partial_marker_len

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_PARAMETER_CLOSE = "</parameter>"
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclass(frozen=True)
class ParsedToolCall:
    """A complete, well-formed call; ``arguments`` typed by the tool's schema (read-only mapping)."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ToolSchemas:
    """Function name -> its parameters' ``properties`` schema, from the request's tools (OpenAI
    ``{"type": "function", "function": {...}}`` entries or bare ``{"name", "parameters"}`` ones)."""

    properties: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_tools(cls, tools: Sequence[Mapping[str, Any]]) -> ToolSchemas:
        found: dict[str, Mapping[str, Any]] = {}
        for tool in tools:
            spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
                continue
            params = spec.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            found[spec["name"]] = props if isinstance(props, Mapping) else {}
        return cls(MappingProxyType(found))


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [k for sub in schema[key] for k in _schema_types(sub)]
    return []


def _as_integer(text: str) -> tuple[bool, Any]:
    s = text.strip()
    return (True, int(s)) if _INTEGER.fullmatch(s) else (False, None)


def _as_number(text: str) -> tuple[bool, Any]:
    s = text.strip()
    if _INTEGER.fullmatch(s):
        return True, int(s)
    if _NUMBER.fullmatch(s):
        value = float(s)
        return (True, value) if math.isfinite(value) else (False, None)
    return False, None


def _as_boolean(text: str) -> tuple[bool, Any]:
    s = text.strip().lower()
    return (True, s == "true") if s in ("true", "false") else (False, None)


def _as_json(kind: type) -> Any:
    def convert(text: str) -> tuple[bool, Any]:
        try:
            value = json.loads(text)
        except ValueError:
            return False, None
        return (True, value) if isinstance(value, kind) else (False, None)

    return convert


def _as_null(text: str) -> tuple[bool, Any]:
    return (True, None) if text.strip() in ("null", "None") else (False, None)


_CONVERTERS = {
    "integer": _as_integer,
    "number": _as_number,
    "boolean": _as_boolean,
    "object": _as_json(dict),
    "array": _as_json(list),
    "null": _as_null,
    "string": lambda text: (True, text),
}


def convert_argument(raw: str, schema: Any) -> Any:
    """Type ``raw`` by ``schema`` (see the module docstring); the raw string when nothing fits."""
    for kind in _schema_types(schema):
        converter = _CONVERTERS.get(kind)
        if converter is not None:
            ok, value = converter(raw)
            if ok:
                return value
    return raw


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parse_tool_call(body: str, schemas: ToolSchemas) -> ParsedToolCall | None:
    """Parse the text between ``<tool_call>`` and ``</tool_call>``; None when malformed."""
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name = function.group(1).strip()
    inner = function.group(2)
    properties = schemas.properties.get(name, {})
    arguments: dict[str, Any] = {}
    pos = 0
    while True:
        while pos < len(inner) and inner[pos].isspace():
            pos += 1
        if pos == len(inner):
            break
        opening = _PARAMETER.match(inner, pos)
        if opening is None:
            return None
        end = inner.find(_PARAMETER_CLOSE, opening.end())
        if end < 0:
            return None
        value = inner[opening.end():end]
        arg = opening.group(1).strip()
        if "<parameter=" in value or not arg or arg in arguments:
            return None
        arguments[arg] = convert_argument(_strip_one_newline(value), properties.get(arg))
        pos = end + len(_PARAMETER_CLOSE)
    if not name:
        return None
    return ParsedToolCall(name, MappingProxyType(arguments))


Item = str | ParsedToolCall


@dataclass(frozen=True)
class ToolCallExtractor:
    """Streaming state. ``in_call``: inside ``<tool_call>``, ``held`` is the call text so far; otherwise
    ``held`` is unpublished content (trailing whitespace and/or a partial ``<tool_call>``).
    ``after_call``: only whitespace followed the last complete call. ``gap``: the whitespace dropped
    before the current call, given back if the call turns out malformed."""

    schemas: ToolSchemas = field(default_factory=ToolSchemas, compare=False)
    in_call: bool = False
    held: str = ""
    after_call: bool = False
    gap: str = ""

    def _with(self, **changes: Any) -> ToolCallExtractor:
        values = {"in_call": self.in_call, "held": self.held, "after_call": self.after_call, "gap": self.gap}
        values.update(changes)
        return ToolCallExtractor(self.schemas, **values)

    def feed(self, text: str) -> tuple[ToolCallExtractor, tuple[Item, ...]]:
        state, items = self, []
        while text is not None:
            state, out, text = state._step(text)
            items.extend(i for i in out if i != "")
        return state, tuple(items)

    def _step(self, text: str) -> tuple[ToolCallExtractor, tuple[Item, ...], str | None]:
        window = self.held + text
        if self.in_call:
            end = window.find(CALL_CLOSE)
            if end < 0:
                return self._with(held=window), (), None
            rest = window[end + len(CALL_CLOSE):]
            call = parse_tool_call(window[:end], self.schemas)
            if call is not None:
                return self._with(in_call=False, held="", after_call=True, gap=""), (call,), rest
            raw = self.gap + CALL_OPEN + window[: end + len(CALL_CLOSE)]
            return self._with(in_call=False, held="", after_call=False, gap=""), (raw,), rest
        start = window.find(CALL_OPEN)
        if start >= 0:
            before = window[:start]
            published = before.rstrip()
            if self.after_call:
                published = published.lstrip()
            gap = before[len(before.rstrip()):]
            return (self._with(in_call=True, held="", gap=gap), (published,), window[start + len(CALL_OPEN):])
        cut = len(window) - partial_marker_len(window, (CALL_OPEN,))
        body_end = len(window[:cut].rstrip())
        published = window[:body_end]
        if self.after_call:
            published = published.lstrip()
        after_call = self.after_call and not published
        return self._with(held=window[body_end:], after_call=after_call), (published,), None

    def flush(self, *, calls_only: bool = False) -> tuple[Item, ...]:
        """End of output: an unterminated call is accepted if its function block is complete (the output
        stopped right before ``</tool_call>``), else published as content; held content is published,
        except whitespace after a call.

        ``calls_only`` (a forced tool call: the output's grammar allows nothing but calls): what is held
        can only be a call cut short (or a partial ``<tool_call>``), so the incomplete call is dropped and
        no markup is published as content; a call whose function block is complete is still accepted."""
        if self.in_call:
            body = self.held[: len(self.held) - partial_marker_len(self.held, (CALL_CLOSE,))]
            call = parse_tool_call(body, self.schemas)
            if call is not None:
                return (call,)
            return () if calls_only else (self.gap + CALL_OPEN + self.held,)
        tail = self.held.lstrip() if self.after_call else self.held
        return (tail,) if tail and not calls_only else ()
