"""``ninfer generate`` / ``chat`` constraint flags: flag -> OutputConstraint mapping, and the CLI as a
subprocess on the default model (valid output, and a one-line error for a grammar that does not compile)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
from ninfer.cli import common
from ninfer.cli.main import build_parser
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


def parse(*argv):
    return build_parser().parse_args(["generate", "--prompt", "x", *argv])


def test_flags_map_to_constraints(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "a" | "b"\n')
    assert common.output_constraint(parse()) is None
    assert common.output_constraint(parse("--json")) == OutputConstraint.json_object()
    assert common.output_constraint(parse("--json-schema", str(schema))) == OutputConstraint.json_schema(SCHEMA)
    assert common.output_constraint(parse("--regex", "[0-9]+")) == OutputConstraint.regex("[0-9]+")
    assert common.output_constraint(parse("--choice", "yes", "--choice", "no")) == OutputConstraint.choice(["yes", "no"])
    assert common.output_constraint(parse("--grammar", str(grammar))) == OutputConstraint.gbnf('root ::= "a" | "b"\n')
    assert common.output_options(parse("--json"), chat=False).constraint == OutputConstraint.json_object()
    chat = build_parser().parse_args(["chat", "--regex", "a+"])
    assert common.output_options(chat, chat=True).constraint == OutputConstraint.regex("a+")


def test_constraint_flags_are_mutually_exclusive():
    with pytest.raises(SystemExit):
        parse("--json", "--regex", "a")


def test_an_unreadable_file_names_it(tmp_path):
    with pytest.raises(InvalidConstraintError, match="missing.json"):
        common.output_constraint(parse("--json-schema", str(tmp_path / "missing.json")))


@pytest.fixture(scope="module")
def cli_env(default_artifact):
    return dict(os.environ, NINFER_CACHE_DIR=str(default_artifact.parent.parent))


def _cli(env, *argv):
    return subprocess.run([sys.executable, "-m", "ninfer.cli.main", "generate", "--prompt", "import json\n",
                           "--quiet", "--dtype", "float32", "--temperature", "1.0", *argv],
                          env=env, capture_output=True, text=True, timeout=300)


def test_cli_json_schema_and_regex_outputs_are_valid(cli_env, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = _cli(cli_env, "--json-schema", str(schema), "--seed", "4", "--max-tokens", "64")
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), SCHEMA)
    out = _cli(cli_env, "--regex", r"v[0-9]\.[0-9]{1,2}", "--seed", "5", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"v[0-9]\.[0-9]{1,2}\n", out.stdout), out.stdout


def test_cli_rejects_a_grammar_that_does_not_compile(cli_env, tmp_path):
    grammar = tmp_path / "bad.gbnf"
    grammar.write_text("root ::= missing_rule\n")
    out = _cli(cli_env, "--grammar", str(grammar))
    assert out.returncode == 2
    assert "missing_rule" in out.stderr and "Traceback" not in out.stderr
