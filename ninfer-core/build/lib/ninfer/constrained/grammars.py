"""EBNF of the constraints on the output text itself, through xgrammar's own conversions.

Every kind but ``tools`` constrains the text whatever the model's output format is, so any frontend
can use these (GBNF syntax, root rule ``root``):

- ``gbnf``: the request's grammar, parsed by xgrammar (its normal form);
- ``json_object`` / ``json_schema``: xgrammar's JSON Schema conversion, without free whitespace
  (``, `` and ``: `` separators, like ``json.dumps``), properties in declared order; for a schema,
  strict mode (no properties or items the schema does not name: the output stays valid and the
  model cannot wander into open-ended keys);
- ``regex``: xgrammar's regex conversion (the whole output matches);
- ``choice``: one literal per choice.

A ``tools`` constraint's language is the frontend's tool-call format, so the frontend's
:class:`~ninfer.constrained.compiler.GrammarSource` writes it (with :func:`json_schema_ebnf` and
:func:`regex_ebnf` for the argument values).

Invariant: every text returned parses with ``xgrammar.Grammar.from_ebnf``; JSON strings never contain
raw control characters (see :func:`~ninfer.constrained.ebnf.tighten_json_strings`). Every failure is an
:class:`~ninfer.contracts.errors.InvalidConstraintError` whose message is xgrammar's, cleaned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ninfer.constrained.ebnf import literal, tighten_json_strings
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError

# xgrammar prefixes its errors with a timestamp and its C++ source location; the rest is the message.
_NOISE = re.compile(r"\[[0-9:.]+\]\s*\S+\.(?:cc|h|cpp):\d+:\s*|Check failed: \(.*?\) is false:\s*")


def clean_error(exc: BaseException) -> str:
    """xgrammar's message of ``exc`` on one line, without its timestamp and source location."""
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
    """EBNF of compact JSON valid against ``schema``; ``ban_in_strings``: characters JSON strings must
    escape (a format whose markers start with ``<`` bans it); ``what`` names the schema in errors."""
    text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
    ebnf = _parse(lambda: _xgr().Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict), what)
    return tighten_json_strings(ebnf, ban_in_strings)


# xgrammar turns a regex into EBNF before parsing it; some regex errors (a bad {m,n} bound) surface from that
# second parser, located in the generated grammar, which the user never wrote: the location is dropped.
_EBNF_LOCATION = re.compile(r"EBNF parser error at line \d+, column \d+:\s*")


def regex_ebnf(pattern: str, what: str) -> str:
    """EBNF whose sentences are the strings ``pattern`` matches in full; ``what`` names it in errors."""
    try:
        return _parse(lambda: _xgr().Grammar.from_regex(pattern), what)
    except InvalidConstraintError as exc:
        message = str(exc)
        if _EBNF_LOCATION.search(message) is None:
            raise
        raise InvalidConstraintError(_EBNF_LOCATION.sub("", message)) from exc.__cause__


def text_constraint_ebnf(constraint: OutputConstraint) -> str:
    """EBNF of ``constraint``, of any kind but ``tools`` (see the module docstring)."""
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
        raise InvalidConstraintError("a tools constraint's grammar is the frontend's tool-call format, "
                                     "not a text constraint")
    raise InvalidConstraintError(f"unknown constraint kind {kind!r}")


__all__ = ["clean_error", "json_schema_ebnf", "regex_ebnf", "text_constraint_ebnf"]
