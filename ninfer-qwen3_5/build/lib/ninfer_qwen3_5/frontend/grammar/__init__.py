"""The Qwen output format's grammars for constrained decoding (the engine is core's :mod:`ninfer.constrained`).

:mod:`sources` turns an OutputConstraint into one EBNF grammar (the frontend's GrammarSource), with
:mod:`tool_grammar` for the XML tool-call format.
"""

from ninfer_qwen3_5.frontend.grammar.sources import constraint_ebnf

__all__ = ["constraint_ebnf"]
