"""Embedding one EBNF grammar in another: rule listing and literal-aware renaming.

Grammars are composed as text: each part is first parsed and printed by xgrammar (which validates it
and gives a normal form without comments), then its rules are renamed with a prefix unique to the
part, so the parts' rule names never collide and the composed text can refer to each part's root.

Invariant: :func:`rename_rules` changes identifiers only, never the contents of string literals
``"..."`` or character classes ``[...]``, so the renamed grammar has the same language.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_RULE_DEF = re.compile(r"^([A-Za-z_][A-Za-z0-9_\-]*)\s*::=", re.M)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def rule_names(ebnf: str) -> list[str]:
    return _RULE_DEF.findall(ebnf)


def rename_rules(ebnf: str, mapping: Mapping[str, str]) -> str:
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch in "\"[":
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
            continue
        m = _IDENT.match(ebnf, i)
        if m is not None and (i == 0 or not (ebnf[i - 1].isalnum() or ebnf[i - 1] in "_-")):
            word = m.group(0)
            out.append(mapping.get(word, word))
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def embed(ebnf: str, prefix: str) -> tuple[str, str]:
    """Rename every rule of ``ebnf`` to ``prefix + name``; returns (renamed text, its root's name)."""
    names = rule_names(ebnf)
    if "root" not in names:
        raise ValueError("the grammar has no root rule")
    renamed = rename_rules(ebnf, {name: prefix + name for name in names})
    return renamed, prefix + "root"


__all__ = ["embed", "rename_rules", "rule_names"]
