"""Fixtures of the constrained-decoding tests.

The real Qwen3.5 vocabulary (248,077 ids) and a QwenFrontend over it are the frontend tests' own
session fixtures (same builder, same cached tokenizer.json), re-exported here. ``byte_compiler``
compiles grammars against a 256-token byte vocabulary plus one EOS, to check a grammar's *language*
independently of any tokenizer. The default model comes from the suite-wide ``default_artifact``.
"""

from __future__ import annotations

import pytest
from frontend.conftest import frontend, resources, tokenizer_json_path  # noqa: F401 - re-exported fixtures

BYTE_EOS = 256


@pytest.fixture(scope="session")
def byte_compiler():
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b""], xgr.VocabType.RAW, vocab_size=257,
                             stop_token_ids=[BYTE_EOS])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


_COMPILED: dict[tuple[int, str], object] = {}


def in_language(byte_compiler, ebnf: str, text: str) -> bool:
    """Whether ``text`` (as UTF-8 bytes) is a complete sentence of the grammar ``ebnf``."""
    import xgrammar as xgr

    key = (id(byte_compiler), ebnf)
    if key not in _COMPILED:
        _COMPILED[key] = byte_compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
    m = xgr.GrammarMatcher(_COMPILED[key])
    for b in text.encode("utf-8"):
        if not m.accept_token(b):
            return False
    return m.accept_token(BYTE_EOS)
