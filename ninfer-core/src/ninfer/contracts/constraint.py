"""What a request asks its output to satisfy: :class:`OutputConstraint` (constrained decoding).

A constraint is part of :class:`~ninfer.contracts.frontend.OutputOptions`. The Frontend compiles
it on the submitting thread (a constraint that does not compile is an
:class:`~ninfer.contracts.errors.InvalidConstraintError`, raised by ``submit``); the request's
OutputSession then owns a matcher, and every token the request samples is drawn from the tokens the
matcher allows (docs/design.md section 4).

Kinds and their source (exactly the fields of the kind are set; the constructors below are the way
to build one):

- ``gbnf``: ``text`` is a GBNF grammar (llama.cpp syntax; the start rule is ``root``);
- ``json_object``: any JSON object; no source;
- ``json_schema``: ``text`` is the JSON Schema, serialized with its key order kept (property order
  is the order the output writes them);
- ``choice``: ``choices`` are the allowed outputs, verbatim;
- ``regex``: ``text`` is a regular expression the whole output must match;
- ``tools``: the output is exactly one tool call in the frontend's tool-call format (``parallel``: one or more) of a tool in
  ``OutputOptions.tools``, whose arguments satisfy that tool's parameter schema; ``tool_choice`` is
  ``"required"`` (any tool) or a tool name.

Invariants: the value is immutable and hashable (it keys the compiled-grammar cache with the
vocabulary); the constructors check only the shape, compilation checks the content.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ninfer.contracts import constraint_limits as limits
from ninfer.contracts.errors import InvalidConstraintError

ConstraintKind = Literal["gbnf", "json_object", "json_schema", "choice", "regex", "tools"]
KINDS: tuple[str, ...] = ("gbnf", "json_object", "json_schema", "choice", "regex", "tools")


@dataclass(frozen=True)
class OutputConstraint:
    """See the module docstring. Build with :meth:`gbnf`, :meth:`json_object`, :meth:`json_schema`,
    :meth:`choice`, :meth:`regex` or :meth:`tools`."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    tool_choice: str = ""
    parallel: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidConstraintError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        needs_text = self.kind in ("gbnf", "json_schema", "regex")
        if needs_text and not (isinstance(self.text, str) and self.text.strip()):
            raise InvalidConstraintError(f"a {self.kind} constraint needs a non-empty source")
        if not needs_text and self.text:
            raise InvalidConstraintError(f"a {self.kind} constraint takes no source text")
        if self.kind == "choice":
            if not self.choices:
                raise InvalidConstraintError("a choice constraint needs at least one choice")
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise InvalidConstraintError("every choice must be a non-empty string")
        elif self.choices:
            raise InvalidConstraintError(f"a {self.kind} constraint takes no choices")
        if self.kind == "tools":
            if not isinstance(self.tool_choice, str) or not self.tool_choice:
                raise InvalidConstraintError('a tools constraint needs tool_choice "required" or a tool name')
        elif self.tool_choice or self.parallel:
            raise InvalidConstraintError(f"a {self.kind} constraint takes no tool_choice/parallel")
        self._check_limits()

    def _check_limits(self) -> None:
        """The source-size limits of :mod:`~ninfer.contracts.constraint_limits` (before any compile)."""
        if self.kind == "regex":
            limits.check_regex(self.text)
        elif self.kind == "choice":
            limits.check_choices(self.choices)
        elif self.kind == "gbnf":
            limits.check_source_bytes(self.text, "the grammar")
        elif self.kind == "json_schema":
            limits.check_source_bytes(self.text, "the JSON schema")
            try:
                document = json.loads(self.text)
            except RecursionError:
                raise InvalidConstraintError(f"the JSON schema is nested too deeply (MAX_SCHEMA_DEPTH is "
                                             f"{limits.MAX_SCHEMA_DEPTH})") from None
            except ValueError as exc:
                raise InvalidConstraintError(f"the JSON schema is not valid JSON: {exc}") from exc
            limits.check_schema_document(document)

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def gbnf(cls, grammar: str) -> OutputConstraint:
        return cls("gbnf", text=grammar)

    @classmethod
    def json_object(cls) -> OutputConstraint:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> OutputConstraint:
        """``schema`` as a mapping or as JSON text; either way it must be a JSON object."""
        if isinstance(schema, str):
            try:
                value = json.loads(schema)
            except ValueError as exc:
                raise InvalidConstraintError(f"the JSON schema is not valid JSON: {exc}") from exc
            except RecursionError:
                raise InvalidConstraintError(f"the JSON schema is nested too deeply (MAX_SCHEMA_DEPTH is "
                                             f"{limits.MAX_SCHEMA_DEPTH})") from None
        else:
            value = schema
        if not isinstance(value, Mapping):
            raise InvalidConstraintError("a JSON schema must be a JSON object")
        try:
            text = json.dumps(value, ensure_ascii=False)  # key order kept: it is the output's order
        except (TypeError, ValueError) as exc:
            raise InvalidConstraintError(f"the JSON schema is not JSON-serializable: {exc}") from exc
        except RecursionError:
            raise InvalidConstraintError(f"the JSON schema is nested too deeply (MAX_SCHEMA_DEPTH is "
                                         f"{limits.MAX_SCHEMA_DEPTH})") from None
        return cls("json_schema", text=text)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> OutputConstraint:
        return cls("choice", choices=tuple(choices))

    @classmethod
    def regex(cls, pattern: str) -> OutputConstraint:
        return cls("regex", text=pattern)

    @classmethod
    def tools(cls, tool_choice: str = "required", *, parallel: bool = False) -> OutputConstraint:
        return cls("tools", tool_choice=tool_choice, parallel=bool(parallel))

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema of a ``json_schema`` constraint (a fresh copy)."""
        if self.kind != "json_schema":
            raise ValueError(f"a {self.kind} constraint has no JSON schema")
        return json.loads(self.text)


__all__ = ["KINDS", "ConstraintKind", "OutputConstraint"]
