"""The constraint source limits (ninfer.contracts.constraint_limits): each is refused by name before any
compile, the boundary value itself is accepted, and nothing nested deeply can exhaust the stack."""

from __future__ import annotations

import pytest
from ninfer.contracts import constraint_limits as L
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError


def nested_schema(levels: int) -> dict:
    """A schema whose document nests ``2 * levels + 1`` JSON containers (object -> properties -> ...)."""
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def refused(build, limit_name: str) -> str:
    with pytest.raises(InvalidConstraintError) as info:
        build()
    assert limit_name in str(info.value), str(info.value)
    return str(info.value)


def test_schema_depth_limit():
    levels = (L.MAX_SCHEMA_DEPTH - 1) // 2
    OutputConstraint.json_schema(nested_schema(levels))
    refused(lambda: OutputConstraint.json_schema(nested_schema(levels + 1)), "MAX_SCHEMA_DEPTH")


@pytest.mark.parametrize("levels", [5_000, 200_000])
def test_absurd_nesting_is_refused_not_a_crash(levels):
    """Past Python's recursion limit the parser itself refuses, by the same limit's name."""
    text = '{"items":' * levels + "{}" + "}" * levels
    refused(lambda: OutputConstraint.json_schema(text), "MAX_SCHEMA_DEPTH")


def test_enum_members_limit_counts_the_whole_schema():
    half = L.MAX_ENUM_MEMBERS // 2
    ok = {"type": "object", "properties": {"a": {"enum": list(range(half))}, "b": {"enum": list(range(half))}}}
    OutputConstraint.json_schema(ok)
    ok["properties"]["c"] = {"enum": ["one more"]}
    msg = refused(lambda: OutputConstraint.json_schema(ok), "MAX_ENUM_MEMBERS")
    assert str(L.MAX_ENUM_MEMBERS + 1) in msg


def test_source_bytes_limit_for_schema_and_grammar():
    big = {"type": "string", "description": "x" * L.MAX_SOURCE_BYTES}
    refused(lambda: OutputConstraint.json_schema(big), "MAX_SOURCE_BYTES")
    refused(lambda: OutputConstraint.gbnf('root ::= "a"\n' + "# pad\n" * (L.MAX_SOURCE_BYTES // 6)),
            "MAX_SOURCE_BYTES")


def test_regex_length_limit():
    OutputConstraint.regex("a" * L.MAX_REGEX_CHARS)
    refused(lambda: OutputConstraint.regex("(a|b)*" * (L.MAX_REGEX_CHARS // 6 + 1)), "MAX_REGEX_CHARS")


def test_choices_limit():
    OutputConstraint.choice([f"c{i}" for i in range(L.MAX_CHOICES)])
    refused(lambda: OutputConstraint.choice([f"c{i}" for i in range(L.MAX_CHOICES + 1)]), "MAX_CHOICES")


def test_tools_limits_are_checked_before_compiling():
    """The tools constraint's schemas live in the request's tools: GrammarCompiler checks them first (this
    compiler's source would fail the test if it were ever asked for text)."""
    from ninfer.constrained.compiler import GrammarCompiler

    def never(*_a, **_k):
        raise AssertionError("a tools constraint past a limit reached the grammar source")

    compiler = GrammarCompiler([bytes([i]) for i in range(256)], frozenset(), 257, [256], source=never)
    deep = [{"type": "function", "function": {"name": "f", "parameters": nested_schema(L.MAX_SCHEMA_DEPTH)}}]
    refused(lambda: compiler.compile(OutputConstraint.tools(), deep), "MAX_SCHEMA_DEPTH")
    wide = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": list(range(L.MAX_ENUM_MEMBERS + 1))}}}}}]
    refused(lambda: compiler.compile(OutputConstraint.tools(), wide), "MAX_ENUM_MEMBERS")


def _items(levels: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(levels):
        s = {"type": "array", "items": s}
    return s


# The worst sources the limits let through, compiled against the real Qwen3.5 vocabulary (248,077 ids).
WORST_WITHIN_LIMITS = {
    "depth": lambda: OutputConstraint.json_schema(nested_schema((L.MAX_SCHEMA_DEPTH - 1) // 2)),
    "array depth": lambda: OutputConstraint.json_schema(_items(L.MAX_SCHEMA_DEPTH - 1)),
    "enum": lambda: OutputConstraint.json_schema({"enum": [f"value number {i}" for i in range(L.MAX_ENUM_MEMBERS)]}),
    "choices": lambda: OutputConstraint.choice([f"choice {i}" for i in range(L.MAX_CHOICES)]),
    "regex": lambda: OutputConstraint.regex("(a|b|ab|ba)*c{1,50}" * (L.MAX_REGEX_CHARS // 19)),
}
# Far above what these take on a loaded 2-core machine: a source that took this long would be a missing limit.
COMPILE_SECONDS = 30.0


@pytest.mark.parametrize("name", sorted(WORST_WITHIN_LIMITS))
def test_worst_sources_within_limits_compile_in_bounded_time(frontend, name):
    import time

    compiler = frontend.grammar_compiler()
    constraint = WORST_WITHIN_LIMITS[name]()
    started = time.monotonic()
    compiler.compile(constraint)
    assert time.monotonic() - started < COMPILE_SECONDS
