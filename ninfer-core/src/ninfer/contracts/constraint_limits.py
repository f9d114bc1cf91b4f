"""Size limits on constraint sources, checked before anything is compiled.

Compiling a grammar is native code that cannot be interrupted, and its time and memory grow with the source:
a JSON schema's nesting depth (superlinearly), its enum members, a regex's or grammar's length, a choice list.
Each limit below is checked on the source alone, in time linear in its size, so a request past one is refused
(an :class:`~ninfer.contracts.errors.InvalidConstraintError`, an HTTP 400) before it costs a compile. Every
message names the limit by its constant's name and states the value found and the bound.

Invariant: a source within every limit compiles in bounded time on the default vocabulary (well under a
second per constraint); the limits are generous for real schemas (an OpenAI strict schema allows 5 levels of
nesting and 500 enum values in total).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ninfer.contracts.errors import InvalidConstraintError

MAX_SOURCE_BYTES = 256 * 1024      # a JSON schema, GBNF grammar or the request's tools, UTF-8 encoded
MAX_REGEX_CHARS = 4096             # a regex constraint's pattern
MAX_SCHEMA_DEPTH = 64              # JSON containers nested in a schema document (a property level is two)
MAX_ENUM_MEMBERS = 4096            # enum values summed over a whole schema document
MAX_CHOICES = 4096                 # a choice constraint's alternatives


def _refuse(what: str, found: int, limit_name: str, limit: int) -> None:
    raise InvalidConstraintError(f"{what} {found}, over the limit of {limit} ({limit_name})")


def check_source_bytes(text: str, what: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        _refuse(f"the size of {what} in bytes is", size, "MAX_SOURCE_BYTES", MAX_SOURCE_BYTES)


def check_regex(pattern: str) -> None:
    if len(pattern) > MAX_REGEX_CHARS:
        _refuse("the regex length in characters is", len(pattern), "MAX_REGEX_CHARS", MAX_REGEX_CHARS)


def check_choices(choices: Iterable[str]) -> None:
    n = sum(1 for _ in choices)
    if n > MAX_CHOICES:
        _refuse("the number of choices is", n, "MAX_CHOICES", MAX_CHOICES)
    check_source_bytes("".join(choices), "the choices")


def check_schema_document(value: Any, what: str = "the JSON schema") -> None:
    """Depth and enum members of a parsed JSON schema document (or several, e.g. a list of tools); iterative,
    so no nesting can exhaust the stack."""
    depth_max, enums = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
            enum = node.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth_max = max(depth_max, depth)
        if depth_max > MAX_SCHEMA_DEPTH:
            _refuse(f"{what} is nested too deeply: its depth is at least", depth_max, "MAX_SCHEMA_DEPTH",
                    MAX_SCHEMA_DEPTH)
        stack.extend((child, depth + 1) for child in children)
    if enums > MAX_ENUM_MEMBERS:
        _refuse(f"the number of enum members in {what} is", enums, "MAX_ENUM_MEMBERS", MAX_ENUM_MEMBERS)


__all__ = ["MAX_CHOICES", "MAX_ENUM_MEMBERS", "MAX_REGEX_CHARS", "MAX_SCHEMA_DEPTH", "MAX_SOURCE_BYTES",
           "check_choices", "check_regex", "check_schema_document", "check_source_bytes"]
