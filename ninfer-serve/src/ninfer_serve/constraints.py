"""OpenAI/vLLM request fields -> the engine's :class:`OutputConstraint` (constrained decoding).

Accepted sources, at most one per request (two are a 400 naming the second field):

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. ``strict``
  false does not relax anything: the output always satisfies the schema.
- vLLM's ``guided_json`` (schema object or JSON text), ``guided_regex``, ``guided_choice`` (list of
  strings), ``guided_grammar`` (GBNF, root rule ``root``), and the newer
  ``structured_outputs: {json | regex | choice | grammar}`` with the same meanings.
- Anthropic's ``output_config.format`` (and its beta spelling ``output_format``):
  ``{"type": "json_schema", "schema": {...}}``, passed in as ``schemas``.
- ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": ...}}`` with tools:
  :func:`tool_constraint` (the output is a Qwen tool call whose arguments satisfy the tool's schema);
  it cannot be combined with a body constraint.

The mapping checks shapes only; whether a grammar or schema compiles is decided by the engine at
submit (``InvalidConstraintError``, a 400 naming the problem and, through :class:`Constrained`, the field).

Every route (/v1/chat/completions, /v1/completions, /v1/messages) goes through :func:`constrain`, so a
field means the same constraint wherever it is accepted and a forced tool call is always a grammar.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError

from ninfer_serve.errors import bad_request
from ninfer_serve.tool_choice import ToolPolicy

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# Every extra request field this module reads (body validation does not log these as unknown).
EXTRA_FIELDS = frozenset((*GUIDED, "structured_outputs"))
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


class ConstraintFieldError(ValueError):
    """A request field does not describe a constraint; ``param`` names the field (for the 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else value


def _from_schema(schema: Any, param: str) -> OutputConstraint:
    if not isinstance(schema, Mapping):
        raise ConstraintFieldError(f"{param} must be a JSON Schema object", param)
    return _build(lambda: OutputConstraint.json_schema(schema), param)


def _from_response_format(value: Any) -> OutputConstraint | None:
    rf = _plain(value)
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise ConstraintFieldError("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint.json_object()
    if kind == "json_schema":
        spec = rf.get("json_schema")
        return _from_schema(spec.get("schema") if isinstance(spec, Mapping) else None,
                            "response_format.json_schema.schema")
    raise ConstraintFieldError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                               "response_format.type")


def _build(make, param: str) -> OutputConstraint:
    try:
        return make()
    except InvalidConstraintError as exc:
        raise ConstraintFieldError(str(exc), param) from exc


def _from_guided(field: str, value: Any, param: str) -> OutputConstraint:
    if field == "guided_json":
        if isinstance(value, str):
            return _build(lambda: OutputConstraint.json_schema(value), param)
        if isinstance(value, Mapping):
            return _build(lambda: OutputConstraint.json_schema(value), param)
        raise ConstraintFieldError(f"{param} must be a JSON Schema object or its JSON text", param)
    if field == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ConstraintFieldError(f"{param} must be a non-empty list of non-empty strings", param)
        return OutputConstraint.choice(value)
    if not isinstance(value, str) or not value:
        raise ConstraintFieldError(f"{param} must be a non-empty string", param)
    if field == "guided_regex":
        return OutputConstraint.regex(value)
    return OutputConstraint.gbnf(value)


@dataclass(frozen=True)
class Constrained:
    """A request's output constraint (None: unconstrained) and the request field it came from: what a 400 names
    when the engine cannot compile it (None without a constraint)."""

    constraint: OutputConstraint | None = None
    param: str | None = None


def body_constraint(response_format: Any = None, extra: Mapping[str, Any] | None = None,
                    schemas: Mapping[str, Any] | None = None) -> OutputConstraint | None:
    """The constraint of ``response_format``, the vLLM fields in ``extra`` (the request's unknown
    fields, e.g. a pydantic ``model_extra``) and ``schemas`` (field path -> a JSON Schema the output must
    satisfy: Anthropic's ``output_config.format``); None when the request has none."""
    return _body(response_format, extra, schemas).constraint


def _body(response_format: Any, extra: Mapping[str, Any] | None, schemas: Mapping[str, Any] | None) -> Constrained:
    found: list[tuple[str, OutputConstraint]] = []
    rf = _from_response_format(response_format)
    if rf is not None:
        found.append(("response_format", rf))
    for param, schema in (schemas or {}).items():
        found.append((param, _from_schema(schema, param)))
    extra = dict(extra or {})
    for field in GUIDED:
        if extra.get(field) is not None:
            found.append((field, _from_guided(field, extra[field], field)))
    structured = extra.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, Mapping):
            raise ConstraintFieldError("structured_outputs must be an object", "structured_outputs")
        for key, field in _STRUCTURED.items():
            if structured.get(key) is not None:
                param = f"structured_outputs.{key}"
                found.append((param, _from_guided(field, structured[key], param)))
    if len(found) > 1:
        raise ConstraintFieldError(f"only one output constraint may be given, got {', '.join(f for f, _ in found)}",
                                   found[1][0])
    if not found:
        return Constrained()
    field, constraint = found[0]
    # A schema that does not compile is the schema's fault: name it, not the whole response_format.
    schema = field == "response_format" and constraint.kind == "json_schema"
    return Constrained(constraint, "response_format.json_schema.schema" if schema else field)


def tool_constraint(tool_choice: Any, *, has_tools: bool, parallel: bool) -> OutputConstraint | None:
    """``tool_choice`` required/named as a tools constraint (None for auto/none/absent)."""
    choice = _plain(tool_choice)
    if choice is None or choice in ("auto", "none"):
        return None
    if not has_tools:
        raise ConstraintFieldError("tool_choice forces a tool call but the request has no tools", "tool_choice")
    if choice == "required":
        return OutputConstraint.tools("required", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ConstraintFieldError("tool_choice must be none, auto, required or {type: function, function: {name}}",
                                   "tool_choice")
    return OutputConstraint.tools(name, parallel=parallel)


def request_constraint(*, response_format: Any = None, extra: Mapping[str, Any] | None = None,
                       schemas: Mapping[str, Any] | None = None, tool_choice: Any = None, has_tools: bool = False,
                       parallel: bool = True) -> Constrained:
    """The one constraint of a request, a body constraint or a forced tool call (whose grammar comes from
    ``tools``), with its field."""
    body = _body(response_format, extra, schemas)
    tools = tool_constraint(tool_choice, has_tools=has_tools, parallel=parallel)
    if body.constraint is not None and tools is not None:
        raise ConstraintFieldError("a forced tool call (tool_choice required or named, Anthropic's any or tool) "
                                   "cannot be combined with an output format (response_format, output_config.format "
                                   "or guided_*)", "tool_choice")
    return body if tools is None else Constrained(tools, "tools")


def constrain(policy: ToolPolicy | None, *, response_format: Any = None, extra: Mapping[str, Any] | None = None,
              schemas: Mapping[str, Any] | None = None) -> Constrained:
    """A route's output constraint: the body constraint of ``response_format`` / the vLLM fields in
    ``extra`` / the JSON Schemas in ``schemas``, or the forced tool call of ``policy`` (tool_choice
    required/named, already checked against the request's tools by ``tool_policy``). A field that describes no
    constraint is a 400 naming it. ``policy`` None: the route has no tools (/v1/completions)."""
    mode = policy.mode if policy is not None else "none"
    choice: Any = None  # the policy in Chat Completions' tool_choice form, which request_constraint reads
    if mode == "required":
        choice = "required"
    elif mode == "named":
        choice = {"type": "function", "function": {"name": policy.name}}
    try:
        return request_constraint(response_format=response_format, extra=extra, schemas=schemas, tool_choice=choice,
                                  has_tools=choice is not None, parallel=policy is None or policy.parallel)
    except ConstraintFieldError as exc:
        raise bad_request(str(exc), param=exc.param) from None


__all__ = ["GUIDED", "ConstraintFieldError", "Constrained", "body_constraint", "constrain", "request_constraint",
           "tool_constraint"]
