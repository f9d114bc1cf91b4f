"""Constrained decoding (GBNF, JSON, JSON Schema, choice, regex, tool calls) for any frontend.

The engine is xgrammar (docs/constrained.md says why). The pieces: :mod:`grammars` writes the EBNF of
the constraints on the output text itself; a frontend adds what depends on its output format (its tool
calls, a reasoning prefix) as a :class:`GrammarSource`, with :mod:`ebnf` and :mod:`rules` to write and
compose grammar text; :mod:`compiler` compiles that text against the vocabulary with a cache shared by
all requests; :mod:`matcher` is the per-request matcher the OutputSession previews and commits, and the
mask provider sampling reads; :mod:`min_tokens` holds stop tokens back on top of it (or of no grammar) while an
output is shorter than its ``min_tokens``.
"""

from ninfer.constrained.compiler import GrammarCompiler, GrammarSource
from ninfer.constrained.matcher import Advance, ConstraintMatcher

__all__ = ["Advance", "ConstraintMatcher", "GrammarCompiler", "GrammarSource"]
