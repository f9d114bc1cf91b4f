"""The grammar of a Qwen3.5 XML tool call whose arguments satisfy the tool's JSON schema.

The language (the chat template's own rendering; ``tool_calls.py`` parses it)::

    <tool_call>\\n<function=NAME>\\n
    <parameter=ARG>\\nVALUE\\n</parameter>\\n      (each declared parameter at most once, in declared order;
                                                   required ones always)
    </function>\\n</tool_call>

``tool_choice`` ``"required"``: a call of any of the tools; a tool name: a call of that tool.
``parallel``: one or more calls separated by ``\\n``; otherwise exactly one.

Invariant (what makes the output valid): every VALUE the grammar allows is turned by
:func:`~ninfer_qwen3_5.frontend.tool_calls.convert_argument` into a value its schema accepts, so the
parsed call's arguments validate against the tool's parameters schema. Hence:

- string parameters are raw text (the parser keeps it verbatim): an ``enum``/``const`` is one of its
  literals, a ``pattern`` is matched in full, ``minLength``/``maxLength`` count characters of a text
  without ``<``; otherwise any text in which ``<`` is never followed by ``/`` or ``p`` (so it cannot
  close the parameter or open another);
- other parameters are compact JSON from the parameter's schema (xgrammar's JSON Schema grammar), with
  ``<`` and control characters banned inside JSON strings (JSON writes them as ``\\u003c``);
- schemas the parser could not type back unambiguously are rejected: a union of ``string`` with another
  type, a non-string ``enum``/``const`` without ``type``, ``format`` on a string parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ninfer.constrained.ebnf import literal
from ninfer.constrained.rules import embed
from ninfer.contracts.errors import InvalidConstraintError

from ninfer_qwen3_5.frontend.tool_calls import _schema_types

# (schema, what) -> EBNF text with a root rule; raises InvalidConstraintError.
JsonGrammar = Callable[[Mapping[str, Any], str], str]
RegexGrammar = Callable[[str, str], str]

_FREE_TEXT = '([^<] | "<"+ [^</p])* "<"*'
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                "writeOnly"}


def _tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    specs: list[tuple[str, Mapping[str, Any]]] = []
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise InvalidConstraintError(f"tool {tool!r} has no function name")
        params = spec.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise InvalidConstraintError(f"tool {spec['name']!r}: parameters must be a JSON schema object")
        specs.append((spec["name"], params))
    return specs


def _check_name(name: str, what: str) -> None:
    # The parser reads names as [^>\n]+ and strips them; '<' would break the markers.
    if not name or name != name.strip() or any(c in name for c in "<>\n"):
        raise InvalidConstraintError(f"{what} {name!r} cannot be written in a Qwen XML tool call")


def _string_value(schema: Mapping[str, Any], what: str, regex: RegexGrammar, prefix: str) -> tuple[str, str]:
    """(extra rules, expression) for a raw-text parameter."""
    if "format" in schema:
        raise InvalidConstraintError(f"{what}: 'format' is not supported for string tool parameters")
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        if not values or not all(isinstance(v, str) for v in values):
            raise InvalidConstraintError(f"{what}: a string enum/const needs string values")
        return "", "(" + " | ".join(literal(v) for v in values) + ")"
    if "pattern" in schema:
        if "minLength" in schema or "maxLength" in schema:
            raise InvalidConstraintError(f"{what}: pattern together with minLength/maxLength is not supported")
        rules, root = embed(regex(schema["pattern"], what), prefix)
        return rules, root
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
        raise InvalidConstraintError(f"{what}: invalid minLength/maxLength")
    if lo == 0 and hi is None:
        return "", f"({_FREE_TEXT})"
    return "", f"[^<]{{{lo},{'' if hi is None else hi}}}"


def _parameter_value(schema: Any, defs: Mapping[str, Any], what: str, json_grammar: JsonGrammar,
                     regex: RegexGrammar, prefix: str) -> tuple[str, str]:
    if schema is True or schema == {}:
        return "", f"({_FREE_TEXT})"
    if not isinstance(schema, Mapping):
        raise InvalidConstraintError(f"{what}: the schema must be an object")
    types = _schema_types(schema)
    if not types:
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if values is not None and all(isinstance(v, str) for v in values):
            return _string_value(schema, what, regex, prefix)
        if set(schema) <= _ANNOTATIONS:
            return "", f"({_FREE_TEXT})"
        raise InvalidConstraintError(f"{what}: give the parameter a 'type' (the tool-call parser types "
                                     f"arguments by it)")
    if "string" in types:
        if set(types) != {"string"}:
            raise InvalidConstraintError(f"{what}: a union of string with {sorted(set(types) - {'string'})} is "
                                         f"ambiguous in the XML format (strings are raw text)")
        return _string_value(schema, what, regex, prefix)
    sub = dict(schema)
    sub.update({k: v for k, v in defs.items() if k not in sub})
    rules, root = embed(json_grammar(sub, what), prefix)
    return rules, root


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], tool_choice: str, parallel: bool,
                      json_grammar: JsonGrammar, regex: RegexGrammar) -> str:
    """EBNF text (root rule ``root``) of the tool-call language described in the module docstring."""
    specs = _tool_specs(tools)
    if not specs:
        raise InvalidConstraintError("a tools constraint needs at least one tool in the request's tools")
    names = [name for name, _ in specs]
    if len(set(names)) != len(names):
        raise InvalidConstraintError(f"tool names must be unique: {names}")
    if tool_choice != "required":
        specs = [(n, p) for n, p in specs if n == tool_choice]
        if not specs:
            raise InvalidConstraintError(f"tool_choice names {tool_choice!r}, which is not among the tools {names}")
    rules: list[str] = []
    calls: list[str] = []
    for t, (name, params) in enumerate(specs):
        _check_name(name, "tool name")
        if params.get("type", "object") != "object":
            raise InvalidConstraintError(f"tool {name!r}: parameters must have type object")
        props = params.get("properties") or {}
        required = list(params.get("required") or ())
        unknown = [r for r in required if r not in props]
        if unknown:
            raise InvalidConstraintError(f"tool {name!r}: required parameters {unknown} are not declared")
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        parts = [literal(f"<tool_call>\n<function={name}>\n")]
        for a, (arg, schema) in enumerate(props.items()):
            _check_name(arg, f"tool {name!r} parameter")
            extra, value = _parameter_value(schema, defs, f"tool {name!r} parameter {arg!r}", json_grammar,
                                            regex, f"t{t}_p{a}_")
            if extra:
                rules.append(extra)
            block = f"{literal(f'<parameter={arg}>' + chr(10))} {value} {literal(chr(10) + '</parameter>' + chr(10))}"
            parts.append(block if arg in required else f"({block})?")
        parts.append(literal("</function>\n</tool_call>"))
        rules.append(f"call_{t} ::= " + " ".join(parts))
        calls.append(f"call_{t}")
    head = f"root ::= call ({literal(chr(10))} call)*" if parallel else "root ::= call"
    return "\n".join([head, "call ::= " + " | ".join(calls), *rules]) + "\n"


__all__ = ["tool_call_grammar"]
