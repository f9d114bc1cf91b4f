"""GBNF/EBNF text helpers for the grammars NInfer writes itself (choices, framing, tool calls).

Invariants:
- :func:`literal` returns an EBNF string literal that matches exactly its argument (every character
  that is special inside a literal, and every control character, is escaped).
- :func:`text_without` returns rules whose language is every string (including the empty one) that
  does not contain its argument; it needs an argument whose first character does not occur again in
  it (true of the markers it is used for: ``</think>``).
- :func:`tighten_json_strings` only removes characters from negated character classes of a JSON
  grammar's string rules, so the language it returns is a subset of the one it was given.
"""

from __future__ import annotations

import re

_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CLASS_ESCAPES = {"\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-", "[": "\\[", "\n": "\\n", "\r": "\\r",
                  "\t": "\\t"}


def _escape_char(ch: str, table: dict[str, str]) -> str:
    if ch in table:
        return table[ch]
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\x{ord(ch):02x}"
    return ch


def literal(text: str) -> str:
    """``"..."`` matching exactly ``text`` (the empty string gives ``""``)."""
    return '"' + "".join(_escape_char(c, _LITERAL_ESCAPES) for c in text) + '"'


def char_class(chars: str, *, negated: bool = False) -> str:
    body = "".join(_escape_char(c, _CLASS_ESCAPES) for c in dict.fromkeys(chars))
    return f"[{'^' if negated else ''}{body}]"


def text_without(name: str, forbidden: str) -> str:
    """Rules defining ``name`` = any text that does not contain ``forbidden`` (see module docstring).

    With ``forbidden = c0 c1 .. c(n-1)`` and c0 not occurring again, a string avoids it exactly when
    it is a sequence of units: a character other than c0; or a run of c0-started partial matches
    (each ``c0 c1..c(j-1)``, j < n, cut short by the next c0) ending in ``c0 c1..c(k-1)`` followed
    by a character that is neither c0 nor ck (k < n) -- or, at the very end, with nothing after it.
    """
    if not forbidden or forbidden[0] in forbidden[1:]:
        raise ValueError(f"text_without needs a marker whose first character does not recur: {forbidden!r}")
    c0, n = forbidden[0], len(forbidden)
    partial = " | ".join(literal(forbidden[1:j]) for j in range(1, n))  # c0 + this: a proper prefix
    # head: one or more c0-started partial matches, the last one being just c0.
    head = f"({literal(c0)} ({partial}))* {literal(c0)}"
    breaks = " | ".join(f"{name}_head {literal(forbidden[1:k])} {char_class(c0 + forbidden[k], negated=True)}"
                        for k in range(1, n))
    ends = " | ".join(f"{name}_head {literal(forbidden[1:k])}" for k in range(1, n))
    return (f"{name} ::= ({char_class(c0, negated=True)} | {breaks})* ({ends})?\n"
            f"{name}_head ::= {head}\n")


# A JSON grammar's string-content classes look like [^\"\\\r\n] or [^\0-\x1f\"\\\r\n]: negated
# classes that exclude the quote. Each is rewritten to also exclude the control characters (JSON
# forbids them raw in strings; some of xgrammar's length-bounded string rules let them through) and
# ``extra`` characters (a tool call's JSON argument must not contain its XML markers' ``<``; JSON
# can still write it as \u003c).
_NEGATED_STRING_CLASS = re.compile(r'\[\^((?:[^\]\\]|\\.)*\\"(?:[^\]\\]|\\.)*)\]')


def tighten_json_strings(ebnf: str, extra: str = "") -> str:
    def repl(m: re.Match[str]) -> str:
        body = m.group(1)
        if "\\0-\\x1f" not in body:
            body = "\\0-\\x1f" + body
        for ch in extra:
            esc = _escape_char(ch, _CLASS_ESCAPES)
            if esc not in body:
                body += esc
        return f"[^{body}]"

    return _NEGATED_STRING_CLASS.sub(repl, ebnf)


__all__ = ["char_class", "literal", "text_without", "tighten_json_strings"]
