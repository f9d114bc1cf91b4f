"""The Qwen frontend's :class:`~ninfer.constrained.compiler.GrammarSource`: a constraint as one EBNF text.

Every kind but ``tools`` constrains the text itself (:func:`ninfer.constrained.grammars.text_constraint_ebnf`);
``tools`` is the Qwen XML tool-call format (:mod:`tool_grammar`).

When the output starts inside ``<think>`` (the prompt left it open), the grammar first allows free
reasoning (any text without ``</think>``), then ``</think>`` and at most two newlines, then the
constrained body: the constraint applies to the answer, not to the reasoning.

Invariant: every text returned parses with ``xgrammar.Grammar.from_ebnf``; JSON strings never
contain raw control characters (nor ``<`` in tool-call arguments, which would open an XML marker).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.constrained.ebnf import literal, text_without
from ninfer.constrained.grammars import json_schema_ebnf, regex_ebnf, text_constraint_ebnf
from ninfer.constrained.rules import embed
from ninfer.contracts.constraint import OutputConstraint

from ninfer_qwen3_5.frontend.grammar.tool_grammar import tool_call_grammar
from ninfer_qwen3_5.frontend.reasoning import THINK_CLOSE


def _body_ebnf(constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]]) -> str:
    if constraint.kind == "tools":
        return tool_call_grammar(
            tools, constraint.tool_choice, constraint.parallel,
            lambda schema, what: json_schema_ebnf(schema, what, ban_in_strings="<"), regex_ebnf)
    return text_constraint_ebnf(constraint)


def constraint_ebnf(constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]] = (), *,
                    thinking_open: bool = False) -> str:
    """The EBNF text of ``constraint`` in the Qwen output format (a GrammarSource)."""
    body = _body_ebnf(constraint, tools)
    if not thinking_open:
        return body
    rules, root = embed(body, "body_")
    return (f"root ::= reasoning {literal(THINK_CLOSE)} [\\n]{{0,2}} {root}\n"
            f"{text_without('reasoning', THINK_CLOSE)}{rules}")


__all__ = ["constraint_ebnf"]
