"""From an :class:`~ninfer.contracts.constraint.OutputConstraint` to one EBNF grammar text.

Every kind becomes xgrammar EBNF (GBNF syntax, root rule ``root``):

- ``gbnf``: the request's grammar, parsed by xgrammar (its normal form);
- ``json_object`` / ``json_schema``: xgrammar's JSON Schema conversion, without free whitespace
  (``, `` and ``: `` separators, like ``json.dumps``), properties in declared order; for a schema,
  strict mode (no properties or items the schema does not name: the output stays valid and the
  model cannot wander into open-ended keys);
- ``regex``: xgrammar's regex conversion (the whole output matches);
- ``choice``: one literal per choice;
- ``tools``: :mod:`tool_grammar`.

When the output starts inside ``<think>`` (the prompt left it open), the grammar first allows free
reasoning (any text without ``</think>``), then ``</think>`` and at most two newlines, then the
constrained body: the constraint applies to the answer, not to the reasoning.

Invariant: every text returned parses with ``xgrammar.Grammar.from_ebnf``; JSON strings never
contain raw control characters (see :func:`~ninfer_qwen3_5.frontend.grammar.ebnf.tighten_json_strings`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError

from ninfer_qwen3_5.frontend.grammar.ebnf import literal, text_without, tighten_json_strings
from ninfer_qwen3_5.frontend.grammar.rules import embed
from ninfer_qwen3_5.frontend.grammar.tool_grammar import tool_call_grammar
from ninfer_qwen3_5.frontend.reasoning import THINK_CLOSE

# xgrammar prefixes its errors with a timestamp and its C++ source location; the rest is the message.
_NOISE = re.compile(r"\[[0-9:.]+\]\s*\S+\.(?:cc|h|cpp):\d+:\s*|Check failed: \(.*?\) is false:\s*")


def clean_error(exc: BaseException) -> str:
    text = _NOISE.sub("", str(exc)).strip()
    return " ".join(text.split()) or type(exc).__name__


def _xgr():
    import xgrammar

    return xgrammar


def _parse(make, what: str) -> str:
    try:
        return str(make())
    except InvalidConstraintError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise InvalidConstraintError(f"{what} does not compile: {clean_error(exc)}") from exc


def json_schema_ebnf(schema: Mapping[str, Any] | str, what: str, *, strict: bool = True,
                     ban_in_strings: str = "") -> str:
    text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
    ebnf = _parse(lambda: _xgr().Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict), what)
    return tighten_json_strings(ebnf, ban_in_strings)


# xgrammar turns a regex into EBNF before parsing it; some regex errors (a bad {m,n} bound) surface from that
# second parser, located in the generated grammar, which the user never wrote: the location is dropped.
_EBNF_LOCATION = re.compile(r"EBNF parser error at line \d+, column \d+:\s*")


def regex_ebnf(pattern: str, what: str) -> str:
    try:
        return _parse(lambda: _xgr().Grammar.from_regex(pattern), what)
    except InvalidConstraintError as exc:
        message = str(exc)
        if _EBNF_LOCATION.search(message) is None:
            raise
        raise InvalidConstraintError(_EBNF_LOCATION.sub("", message)) from exc.__cause__


def _body_ebnf(constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]]) -> str:
    kind = constraint.kind
    if kind == "gbnf":
        return _parse(lambda: _xgr().Grammar.from_ebnf(constraint.text), "the GBNF grammar")
    if kind == "json_object":
        return json_schema_ebnf({"type": "object"}, "the JSON object grammar", strict=False)
    if kind == "json_schema":
        return json_schema_ebnf(constraint.text, "the JSON schema")
    if kind == "regex":
        return regex_ebnf(constraint.text, f"the regex {constraint.text!r}")
    if kind == "choice":
        return "root ::= " + " | ".join(literal(c) for c in constraint.choices) + "\n"
    if kind == "tools":
        return tool_call_grammar(
            tools, constraint.tool_choice, constraint.parallel,
            lambda schema, what: json_schema_ebnf(schema, what, ban_in_strings="<"), regex_ebnf)
    raise InvalidConstraintError(f"unknown constraint kind {kind!r}")


def constraint_ebnf(constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]] = (), *,
                    thinking_open: bool = False) -> str:
    body = _body_ebnf(constraint, tools)
    if not thinking_open:
        return body
    rules, root = embed(body, "body_")
    return (f"root ::= reasoning {literal(THINK_CLOSE)} [\\n]{{0,2}} {root}\n"
            f"{text_without('reasoning', THINK_CLOSE)}{rules}")


__all__ = ["clean_error", "constraint_ebnf", "json_schema_ebnf", "regex_ebnf"]
