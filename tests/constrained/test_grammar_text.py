"""The grammar text NInfer writes: literals, "text without a marker", rule renaming, JSON string tightening,
each constraint kind's language (checked on a byte vocabulary, against Python oracles), and the compiler's use
of the frontend's GrammarSource."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from ninfer.constrained import Advance, ConstraintMatcher, GrammarCompiler
from ninfer.constrained.ebnf import literal, text_without, tighten_json_strings
from ninfer.constrained.grammars import text_constraint_ebnf
from ninfer.constrained.rules import embed, rename_rules
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError
from ninfer_qwen3_5.frontend.grammar.sources import constraint_ebnf

from .conftest import in_language


@pytest.mark.parametrize("text", ["", "a", 'say "hi"\\n', "tab\there\nnew\r\x01\x7f", "é ü 中文 🙂", "[^x]|()"])
def test_literal_matches_exactly_its_text(byte_compiler, text):
    ebnf = f"root ::= {literal(text)}"
    assert in_language(byte_compiler, ebnf, text)
    assert not in_language(byte_compiler, ebnf, text + "x")
    if text:
        assert not in_language(byte_compiler, ebnf, text[:-1])


@pytest.mark.parametrize("marker", ["</think>", "<ab", "xy"])
def test_text_without_is_exactly_the_strings_avoiding_the_marker(byte_compiler, marker):
    # Every string up to length 6 over the marker's characters plus one outsider (brute force).
    ebnf = "root ::= t\n" + text_without("t", marker)
    alphabet = sorted(set(marker)) + ["z"]
    for n in range(0, 7 if len(alphabet) <= 4 else 5):
        for chars in itertools.product(alphabet, repeat=n):
            s = "".join(chars)
            assert in_language(byte_compiler, ebnf, s) == (marker not in s), (marker, s)
    for s in ["</think", "<</think", "</thin</think", "x</think>y", "</think>", "<" * 9 + "/think>"]:
        if set(s) <= set(alphabet):
            assert in_language(byte_compiler, ebnf, s) == (marker not in s), s


def test_text_without_refuses_a_marker_whose_first_character_recurs():
    with pytest.raises(ValueError):
        text_without("t", "abab")


def test_rename_rules_touches_identifiers_only():
    ebnf = 'root ::= "root" item [root] item\nitem ::= "x\\"root" | root_2\nroot_2 ::= "y"\n'
    renamed, root = embed(ebnf, "p_")
    assert root == "p_root"
    assert renamed == ('p_root ::= "root" p_item [root] p_item\np_item ::= "x\\"root" | p_root_2\n'
                       'p_root_2 ::= "y"\n')
    assert rename_rules("a ::= b-c b\nb ::= \"b\"", {"b": "q"}) == 'a ::= b-c q\nq ::= "b"'


def test_tighten_json_strings_bans_control_characters_and_extras(byte_compiler):
    loose = 'root ::= "\\"" s\ns ::= "\\"" | [^\\"\\\\\\r\\n] s\n'
    assert in_language(byte_compiler, loose, '"a\tb"')
    tight = tighten_json_strings(loose, "<")
    assert not in_language(byte_compiler, tight, '"a\tb"')
    assert not in_language(byte_compiler, tight, '"a<b"')
    assert in_language(byte_compiler, tight, '"a>b"')


def test_choice_language(byte_compiler):
    ebnf = text_constraint_ebnf(OutputConstraint.choice(["yes", "no", 'a "quoted"\nline']))
    for s in ["yes", "no", 'a "quoted"\nline']:
        assert in_language(byte_compiler, ebnf, s)
    for s in ["", "ye", "yesno", "No"]:
        assert not in_language(byte_compiler, ebnf, s)


def test_regex_language_matches_python_fullmatch(byte_compiler):
    pattern = r"[a-c]{2,3}-\d{1,2}(x|yz)?"
    ebnf = text_constraint_ebnf(OutputConstraint.regex(pattern))
    for s in ["ab-1", "abc-12x", "aa-0yz", "ab-", "abcd-1", "ab-123", "ab-1y", "ab-1yz", "ba-9x"]:
        assert in_language(byte_compiler, ebnf, s) == bool(re.fullmatch(pattern, s)), s


def test_json_schema_language_rejects_what_jsonschema_rejects(byte_compiler):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "s": {"type": "string", "maxLength": 3}},
              "required": ["n"], "additionalProperties": False}
    ebnf = text_constraint_ebnf(OutputConstraint.json_schema(schema))
    for value in [{"n": 1}, {"n": 9, "s": "abc"}, {"n": 0}, {"n": 10}, {"s": "a"}, {"n": 2, "s": "abcd"},
                  {"n": 2, "x": 1}]:
        text = json.dumps(value)
        valid = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert in_language(byte_compiler, ebnf, text) == valid, text
    # Raw control characters are not JSON; the grammar never lets one into a string.
    assert not in_language(byte_compiler, ebnf, '{"n": 1, "s": "a\tb"}')


def test_thinking_wrapper_allows_free_reasoning_then_the_body(byte_compiler):
    ebnf = constraint_ebnf(OutputConstraint.choice(["yes", "no"]), thinking_open=True)
    assert in_language(byte_compiler, ebnf, "let me think < / </thin\n</think>\n\nyes")
    assert in_language(byte_compiler, ebnf, "</think>no")
    assert not in_language(byte_compiler, ebnf, "yes")              # the reasoning must be closed first
    assert not in_language(byte_compiler, ebnf, "a</think>b</think>yes")
    assert not in_language(byte_compiler, ebnf, "</think>\n\n\nyes")  # at most two newlines


@pytest.mark.parametrize("constraint, problem", [
    (OutputConstraint.gbnf('root ::= "a" | '), "GBNF"),
    (OutputConstraint.gbnf("root ::= undefined_rule"), "undefined_rule"),
    (OutputConstraint.regex("a(b"), "regex"),
    (OutputConstraint.json_schema({"type": "frobnicate"}), "frobnicate"),
    (OutputConstraint.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "minimum"),
    (OutputConstraint.json_schema({"$ref": "#/$defs/missing"}), "missing"),
])
@pytest.mark.parametrize("source", [text_constraint_ebnf, constraint_ebnf], ids=["core", "qwen"])
def test_a_constraint_that_does_not_compile_names_the_problem(constraint, problem, source):
    with pytest.raises(InvalidConstraintError, match=re.escape(problem)) as info:
        source(constraint)
    assert "/project/" not in str(info.value)  # the engine's source locations are stripped


def test_a_tools_constraint_is_not_a_text_constraint():
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},)
    with pytest.raises(InvalidConstraintError, match="tool-call format"):
        text_constraint_ebnf(OutputConstraint.tools("required"))
    assert "<tool_call>" in constraint_ebnf(OutputConstraint.tools("required"), tools)  # the frontend writes it


def test_the_compiler_compiles_what_the_frontends_source_writes():
    """Core's compiler knows no output format: a source that maps every constraint to "ab" gives grammars of
    exactly "ab", and the cache key reads the tools only for a tools constraint."""
    calls = []

    def source(constraint, tools, *, thinking_open):
        calls.append((constraint.kind, tuple(tools), thinking_open))
        return 'root ::= "ab"\n'

    compiler = GrammarCompiler([bytes([i]) for i in range(256)] + [b""], frozenset({256}), 257, [256],
                               source=source)
    compiled = compiler.compile(OutputConstraint.regex("[0-9]+"))
    assert ConstraintMatcher(compiled, [256]).advance([*b"ab", 256]) == Advance(3, True)
    assert ConstraintMatcher(compiled, [256]).advance([*b"12"]).rejected == ord("1")
    tool = {"type": "function", "function": {"name": "f"}}
    compiler.compile(OutputConstraint.regex("[0-9]+"), [tool])  # tools do not change a regex's grammar
    compiler.compile(OutputConstraint.regex("[0-9]+"), thinking_open=True)
    compiler.compile(OutputConstraint.tools("required"), [tool])
    compiler.compile(OutputConstraint.tools("required"), [tool, tool])
    assert calls == [("regex", (), False), ("regex", (), True), ("tools", (tool,), False),
                     ("tools", (tool, tool), False)]
    assert compiler.compiles == 4 and compiler.cached == 4


def test_a_regex_error_found_in_xgrammars_generated_grammar_has_no_grammar_location():
    # xgrammar checks a {m,n} bound in the EBNF it generates from the regex: its line/column point into text the
    # user never wrote, so they are dropped and the regex itself is named.
    with pytest.raises(InvalidConstraintError) as info:
        text_constraint_ebnf(OutputConstraint.regex("a{2,1}"))
    assert str(info.value) == "the regex 'a{2,1}' does not compile: Lower bound is larger than upper bound: 2 > 1"


@pytest.mark.parametrize("make", [
    lambda: OutputConstraint("gbnf"),
    lambda: OutputConstraint.choice([]),
    lambda: OutputConstraint.choice(["a", ""]),
    lambda: OutputConstraint.json_schema("[1, 2]"),
    lambda: OutputConstraint.json_schema("{not json"),
    lambda: OutputConstraint("regex", text="a", choices=("b",)),
    lambda: OutputConstraint("tools"),
    lambda: OutputConstraint("nonsense"),  # type: ignore[arg-type]
])
def test_malformed_constraints_are_rejected_at_construction(make):
    with pytest.raises(InvalidConstraintError):
        make()


def test_constraints_are_hashable_values_keeping_schema_key_order():
    a = OutputConstraint.json_schema({"b": 1, "a": 2})
    assert a == OutputConstraint.json_schema('{"b": 1, "a": 2}') and hash(a) == hash(OutputConstraint.json_schema({"b": 1, "a": 2}))
    assert list(a.schema) == ["b", "a"]
    assert OutputConstraint.choice(["x"]) != OutputConstraint.choice(["y"])
