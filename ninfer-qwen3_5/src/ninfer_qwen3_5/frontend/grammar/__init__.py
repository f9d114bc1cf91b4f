"""Constrained decoding for Qwen frontends (GBNF, JSON, JSON Schema, choice, regex, tool calls).

The engine is xgrammar (docs/constrained.md says why, with the measurements). The pieces:
:mod:`sources` turns an OutputConstraint into one EBNF grammar (:mod:`tool_grammar` for tool calls,
:mod:`ebnf` and :mod:`rules` to write and compose grammar text); :mod:`compiler` compiles it against the
vocabulary with a cache shared by all requests; :mod:`matcher` is the per-request matcher the
OutputSession previews and commits, and the mask provider sampling reads.
"""

from ninfer_qwen3_5.frontend.grammar.compiler import GrammarCompiler
from ninfer_qwen3_5.frontend.grammar.matcher import Advance, ConstraintMatcher

__all__ = ["Advance", "ConstraintMatcher", "GrammarCompiler"]
